package pgheld_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// One outage holds a partition per aggregate hash: RetryRoute asks every
// held partition of the route at once (eight clicks were eight requests),
// leaves another route's alone (even one whose name the route's is a
// prefix of), skips a partition that moved on to another head than the
// one shown, and writes one audit entry naming the heads.
func TestRetryRouteAsksEveryHeldPartitionOfTheRoute(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	store := pgheld.Store{Pool: pool}
	for _, h := range [][2]string{{"ledger.post@0", "m-0"}, {"ledger.post@1", "m-1"}, {"ledger.post@2", "m-2"}, {"ledger.posting@0", "m-x"}, {"ledger_post@0", "m-y"}} {
		require.NoError(t, store.Held(ctx, h[0], h[1], 2, time.Now(), time.Now().Add(time.Minute), "ledger answered 503"))
	}
	shown := map[string]string{"ledger.post@0": "m-0", "ledger.post@1": "m-1", "ledger.post@2": "m-old"}
	asked, err := pgheld.RetryRoute(ctx, pool, "ledger.post", "ops@test", shown)
	require.NoError(t, err)
	require.Len(t, asked, 2, "@2 moved on to another head than the one shown")
	for _, c := range []struct {
		consumer, head string
		want           bool
	}{{"ledger.post@0", "m-0", true}, {"ledger.post@1", "m-1", true}, {"ledger.post@2", "m-2", false}, {"ledger.posting@0", "m-x", false}, {"ledger_post@0", "m-y", false}} {
		got, err := store.RetryRequested(ctx, c.consumer, c.head)
		require.NoError(t, err)
		require.Equal(t, c.want, got, c.consumer)
	}
	entries := pipelinetest.Audited(t, pool, pgheld.RetryNowAction)
	require.Len(t, entries, 1)
	require.Equal(t, 2, entries[0].Count)
	require.Equal(t, "route ledger.post", entries[0].Scope)

	// A partition left alone keeps a request of its own: an operator's
	// retry now of @2, asked before, survives a route's retry that skips it.
	require.NoError(t, pgheld.RetryNow(ctx, pool, "ledger.post@2", "m-2", "ops@test"))
	_, err = pgheld.RetryRoute(ctx, pool, "ledger.post", "ops@test", shown)
	require.NoError(t, err)
	kept, err := store.RetryRequested(ctx, "ledger.post@2", "m-2")
	require.NoError(t, err)
	require.True(t, kept)

	// Without a shown set (the command line), every held partition.
	asked, err = pgheld.RetryRoute(ctx, pool, "ledger.post", "ops@test", nil)
	require.NoError(t, err)
	require.Len(t, asked, 3)
}

// A hold not refreshed for StaleRetention (its consumer died or was
// renamed) is not shown and is pruned with its copy of the head.
func TestStaleHoldsArePrunedWithTheirHead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	store := pgheld.Store{Pool: pool}
	require.NoError(t, store.Held(ctx, "gone@0", "m-1", 3, time.Now(), time.Now().Add(time.Minute), "x"))
	require.NoError(t, store.KeepHead(ctx, "gone@0", "m-1", []byte(`{"card":"secret"}`), map[string]string{"k": "v"}))
	require.NoError(t, store.Held(ctx, "alive@0", "m-2", 3, time.Now(), time.Now().Add(time.Minute), "x"))
	_, err := pool.Exec(ctx, `UPDATE `+pgheld.Table+` SET updated_at = now() - interval '2 hours' WHERE consumer = 'gone@0'`)
	require.NoError(t, err)
	held, err := pgheld.List(ctx, pool)
	require.NoError(t, err)
	require.Len(t, held, 1)
	n, err := pgheld.PruneStale(ctx, pool)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgheld.Table).Scan(&left))
	require.Equal(t, 1, left)
}

// A hold's clock runs across its heads: a head poisoned (released) and the
// next one failing within SameOutage is the same outage, and its since
// goes on; after a longer quiet it starts again. A released hold is not
// listed, and its copy of the head is gone.
func TestAHoldsClockRunsAcrossHeads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	store := pgheld.Store{Pool: pool}
	first := time.Now().Add(-10 * time.Minute)
	require.NoError(t, store.Held(ctx, "ledger.post@0", "m-1", 5, first, time.Now().Add(time.Minute), "503"))
	require.NoError(t, store.KeepHead(ctx, "ledger.post@0", "m-1", []byte(`{"n":1}`), map[string]string{"k": "v"}))
	require.NoError(t, store.Released(ctx, "ledger.post@0"))
	held, err := pgheld.List(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, held, "released: not held")
	_, err = pgheld.Head(ctx, pool, "ledger.post@0")
	require.ErrorIs(t, err, pgheld.ErrNotHeld)

	require.NoError(t, store.Held(ctx, "ledger.post@0", "m-2", 1, time.Now(), time.Now().Add(time.Minute), "503"))
	held, err = pgheld.List(ctx, pool)
	require.NoError(t, err)
	require.Len(t, held, 1)
	require.WithinDuration(t, first, held[0].Since, time.Second, "the next head in the same outage keeps the clock")
	h, err := pgheld.Head(ctx, pool, "ledger.post@0")
	require.NoError(t, err)
	require.Empty(t, h.Payload, "the new head's copy is its own")

	require.NoError(t, store.Released(ctx, "ledger.post@0"))
	_, err = pool.Exec(ctx, `UPDATE `+pgheld.Table+` SET released_at = now() - interval '5 minutes'`)
	require.NoError(t, err)
	require.NoError(t, store.Held(ctx, "ledger.post@0", "m-3", 1, time.Now(), time.Now().Add(time.Minute), "503"))
	held, err = pgheld.List(ctx, pool)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now(), held[0].Since, 5*time.Second, "after a quiet, a new outage")
}
