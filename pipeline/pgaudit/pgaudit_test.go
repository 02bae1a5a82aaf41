package pgaudit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// An entry needs who and what; the address comes from the context when the
// entry has none, as a field of its own (never joined to the actor); the
// newest entry of an action is found, and the list is newest first.
func TestAuditRecordsWhoWhatAndWhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)

	require.Error(t, pgaudit.Record(ctx, pool, pgaudit.Entry{Action: "poison.discard"}), "no actor")
	require.Error(t, pgaudit.Record(ctx, pool, pgaudit.Entry{Actor: "ops"}), "no action")

	from := pgaudit.WithAddress(ctx, "10.9.9.9:1")
	require.NoError(t, pgaudit.Record(from, pool, pgaudit.Entry{Actor: "oncall@corp.example", Action: "poison.discard", Scope: "group 1", Count: 3,
		Detail: map[string]any{"run": "r-1"}}))
	require.NoError(t, pgaudit.Record(ctx, pool, pgaudit.Entry{Actor: "ops", Action: "handler.pause", Scope: "handler payments.charge", Count: 1}))
	require.NoError(t, pgaudit.Record(ctx, pool, pgaudit.Entry{Actor: "ops", Action: "poison.discard", Count: 1}))

	all, err := pgaudit.List(ctx, pool, 10)
	require.NoError(t, err)
	require.Len(t, all, 3)
	require.Equal(t, "poison.discard", all[0].Action, "newest first")
	first := all[2]
	require.Equal(t, "oncall@corp.example", first.Actor, "the address is not part of the actor")
	require.Equal(t, "10.9.9.9:1", first.Address)
	require.Equal(t, "r-1", first.Detail["run"])
	require.Equal(t, 3, first.Count)

	latest, err := pgaudit.Latest(ctx, pool, "poison.discard")
	require.NoError(t, err)
	require.Equal(t, all[0].ID, latest.ID)
	none, err := pgaudit.Latest(ctx, pool, "no.such.action")
	require.NoError(t, err)
	require.Nil(t, none)
}
