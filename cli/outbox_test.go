package cli_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// `outbox retry-now` and `outbox discard` are the console's library call:
// a group larger than --max is refused before anything changes, a dry run
// counts, a real run acts on the group and says how many.
func TestOutboxActionRefusesMoreThanMaxAndActsOnTheGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	for g := 1; g <= 4; g++ {
		pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{Topic: "orders.placed", AggregateID: fmt.Sprint("a", g), Attempts: 2,
			LastError: "exchange not found", AvailableAt: time.Now().Add(time.Hour), MessageUUID: watermill.NewUUID()})
	}
	ops, err := pgoutbox.NewOperator(pool, testTable)
	require.NoError(t, err)
	var fp string
	require.NoError(t, pool.QueryRow(ctx, `SELECT ferry_fingerprint('exchange not found')`).Scan(&fp))
	group := pgoutbox.Stuck{Kind: pgoutbox.Failing, Fingerprint: fp}

	var out bytes.Buffer
	err = cli.OutboxAction{Action: "discard", Stuck: group, Max: 3, Actor: "test"}.Run(ctx, ops, &out)
	require.ErrorIs(t, err, cli.ErrTooMany)
	n, err := ops.Count(ctx, group)
	require.NoError(t, err)
	require.Equal(t, 4, n, "nothing changed")

	out.Reset()
	require.NoError(t, cli.OutboxAction{Action: "retry-now", Stuck: group, DryRun: true, Max: 10}.Run(ctx, ops, &out))
	require.Contains(t, out.String(), "would retry-now 4 row(s)")

	out.Reset()
	require.NoError(t, cli.OutboxAction{Action: "retry-now", Stuck: group, Max: 10, Actor: "test"}.Run(ctx, ops, &out))
	require.Contains(t, out.String(), "retry-now: 4 row(s)")
	due, err := testTable.CountPending(ctx, pool, pgoutbox.PendingFilter{Due: true})
	require.NoError(t, err)
	require.EqualValues(t, 4, due)

	out.Reset()
	require.NoError(t, cli.OutboxFailing{Limit: 10}.Run(ctx, ops, &out))
	require.Contains(t, out.String(), "exchange not found")
}
