package pgoutbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A relay that finds the database on a newer timeline than the one it
// recorded (here: the recorded one set back, as a promotion leaves it;
// examples/orders/ordersapp's failover tests promote a real standby) makes
// the events dispatched within FailoverReplay of the last dispatch pending
// again, once, whichever of several relays looks first; shadow intents and
// older dispatches stay as they are. A plain restart replays nothing.
func TestRelayReplaysTheDispatchesBeforeAFailoverOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	seed(t, pool, "orders.placed", 30, 30)
	rec := &recorder{Publisher: b.pub}
	cfg := pgoutbox.RelayConfig{FailoverReplay: time.Minute}
	relay := newRelay(t, pool, rec, cfg)
	for {
		res, err := relay.RelayBatch(ctx)
		require.NoError(t, err)
		if res.Claimed == 0 {
			break
		}
	}
	// Ten were written and dispatched long ago, five are shadow intents.
	all := rowsWhere(t, pool, "")
	require.Len(t, all, 30)
	updateWhere(t, pool, "created_at = created_at - interval '1 hour'", "id <= $1", all[9].ID)
	updateWhere(t, pool, "shadowed = true", "id >= $1", all[25].ID)

	// First sight records the timeline; a restart (same timeline) replays nothing.
	res, err := relay.CheckFailover(ctx)
	require.NoError(t, err)
	require.Zero(t, res)
	rec0, err := testTable.Timeline(ctx, pool)
	require.NoError(t, err)
	timeline := rec0.Timeline
	require.Positive(t, timeline)
	res, err = newRelay(t, pool, rec, cfg).CheckFailover(ctx)
	require.NoError(t, err)
	require.Zero(t, res)

	// A promotion since: three relays look at once, one replays.
	promoted(t, pool)
	var (
		mu      sync.Mutex
		replays []pgoutbox.Replay
		wg      sync.WaitGroup
	)
	for range 3 {
		r := newRelay(t, pool, rec, cfg)
		wg.Go(func() {
			res, err := r.CheckFailover(ctx)
			require.NoError(t, err)
			if res != (pgoutbox.Replay{}) {
				mu.Lock()
				replays = append(replays, res)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Len(t, replays, 1, "one relay replays")
	require.Equal(t, timeline-1, replays[0].From)
	require.Equal(t, timeline, replays[0].To)
	require.EqualValues(t, 15, replays[0].Rows, "the dispatches in the window, shadow intents left")
	require.Equal(t, 15, countPending(t, pool, ""))
	require.Zero(t, countPending(t, pool, "shadowed"))
	after, err := testTable.Timeline(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, replays[0].To, after.Timeline)
	require.NotNil(t, after.ReplayedRows)
	require.EqualValues(t, 15, *after.ReplayedRows)

	// They go to the broker again: the same message ids, for the ledger.
	before := map[string]int{}
	rec.mu.Lock()
	for k, v := range rec.published {
		before[k] = v
	}
	rec.mu.Unlock()
	for {
		res, err := relay.RelayBatch(ctx)
		require.NoError(t, err)
		if res.Claimed == 0 {
			break
		}
	}
	again := 0
	for id, n := range rec.published {
		require.Contains(t, before, id, "a replay publishes the same message ids")
		again += n - before[id]
	}
	require.Equal(t, 15, again)

	// Turned off, a promotion replays nothing.
	promoted(t, pool)
	res, err = newRelay(t, pool, rec, pgoutbox.RelayConfig{FailoverReplay: -1}).CheckFailover(ctx)
	require.NoError(t, err)
	require.Zero(t, res)
}
