package cli_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// `poison list`, `requeue` and `discard` run without flags: a dry run says
// what it would do and changes nothing, a discard takes the ids it names
// and names the ones the store does not hold, and the audit log has one
// entry with the ids, written with the action.
func TestPoisonCommandsRunWithoutFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{Topic: "orders.placed", Handler: "billing.charge", Reason: "provider 400"},
		pipelinetest.PoisonRow{Topic: "orders.placed", Handler: "billing.charge", Reason: "provider 400"},
		pipelinetest.PoisonRow{Topic: "orders.placed", Handler: "billing.charge", Reason: "provider 400"})
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	recs, err := store.List(ctx, "", 0)
	require.NoError(t, err)

	var out bytes.Buffer
	require.NoError(t, cli.PoisonList{Filter: pgpoison.Filter{Handler: "billing.charge"}}.Run(ctx, store, &out))
	require.Contains(t, out.String(), "provider 400")

	out.Reset()
	require.NoError(t, cli.PoisonAction{Action: "requeue", Selector: pgpoison.Selector{All: true}, DryRun: true}.Run(ctx, store, &out))
	require.Contains(t, out.String(), "would requeue")
	left, err := store.List(ctx, "", 0)
	require.NoError(t, err)
	require.Len(t, left, 3, "a dry run changes nothing")

	out.Reset()
	err = cli.PoisonAction{Action: "discard", Selector: pgpoison.Selector{IDs: []int64{recs[0].ID, 987654}}, Actor: "ops@test"}.Run(ctx, store, &out)
	require.Error(t, err, "an id the store does not hold fails the command")
	require.Contains(t, err.Error()+out.String(), "987654")
	left, err = store.List(ctx, "", 0)
	require.NoError(t, err)
	require.Len(t, left, 2)
	discards := pipelinetest.Audited(t, pool, "poison.discard")
	require.Len(t, discards, 1)
	require.Equal(t, []any{float64(recs[0].ID)}, discards[0].Detail["ids"])

	require.Error(t, cli.PoisonAction{Action: "requeue", Selector: pgpoison.Selector{}}.Run(ctx, store, &out), "a selector that names nothing is refused")
}
