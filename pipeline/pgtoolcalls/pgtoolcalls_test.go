package pgtoolcalls_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgtoolcalls"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// batchQueuer queues statements on a pgx.Batch, as pgoutbox.Pending does
// for the commit.
type batchQueuer struct{ b *pgx.Batch }

func (q batchQueuer) Queue(sql string, args ...any) { q.b.Queue(sql, args...) }

// A key is claimed once per tool; its result and intents are stored with
// the commit; an unknown key is ErrNoCall; a concurrent claim of one key
// waits for the first and sees it; pruning takes only records past the
// cutoff.
func TestCallsAreClaimedOnceAndKeptWithTheirResult(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	first, err := pgtoolcalls.Claim(ctx, tx, "create_order", "k-1", []byte{1, 2})
	require.NoError(t, err)
	require.True(t, first)

	// A second call with the key waits for the first transaction.
	second := make(chan bool, 1)
	go func() {
		ok, err := pgtoolcalls.Claim(ctx, pool, "create_order", "k-1", []byte{1, 2})
		if err != nil {
			ok = true // reported below as a second claim
		}
		second <- ok
	}()
	select {
	case <-second:
		t.Fatal("a second claim of the key did not wait for the first")
	case <-time.After(200 * time.Millisecond):
	}
	b := &pgx.Batch{}
	pgtoolcalls.QueueResult(batchQueuer{b}, "create_order", "k-1", []byte(`{"order_id":7}`), []string{"m-1", "m-2"})
	require.NoError(t, tx.SendBatch(ctx, b).Close())
	require.NoError(t, tx.Commit(ctx))
	require.False(t, <-second, "the key is the first call's")

	call, err := pgtoolcalls.Get(ctx, pool, "create_order", "k-1")
	require.NoError(t, err)
	require.Equal(t, []byte{1, 2}, call.Digest)
	require.JSONEq(t, `{"order_id":7}`, string(call.Result))
	require.Equal(t, []string{"m-1", "m-2"}, call.IntentIDs)
	_, err = pgtoolcalls.Get(ctx, pool, "create_order", "k-2")
	require.ErrorIs(t, err, pgtoolcalls.ErrNoCall)
	other, err := pgtoolcalls.Claim(ctx, pool, "send_reminder", "k-1", []byte{3})
	require.NoError(t, err)
	require.True(t, other, "keys are per tool")

	n, err := pgtoolcalls.CountBefore(ctx, pool, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	require.Zero(t, n)
	n, err = pgtoolcalls.CountBefore(ctx, pool, time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	gone, err := pgtoolcalls.DeleteBefore(ctx, pool, time.Now().Add(-time.Hour), 100)
	require.NoError(t, err)
	require.Zero(t, gone, "nothing past an hour ago")
	gone, err = pgtoolcalls.DeleteBefore(ctx, pool, time.Now().Add(time.Hour), 1)
	require.NoError(t, err)
	require.EqualValues(t, 1, gone, "at most n")
}
