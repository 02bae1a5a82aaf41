package pgoutbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
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
	// Three delayed: the slow lane sends them and marks each dispatched.
	var delayed []*message.Message
	for i := range 3 {
		// Still delayed at the first batch on a loaded CI machine (200 ms
		// once was not: the append lane sent them as due).
		delayed = append(delayed, pipeline.WithDelay(event(t, fmt.Sprint("late-", i), i), 2*time.Second))
	}
	publish(t, pool, "orders.placed", delayed...)
	rec := &recorder{Publisher: b.pub}
	cfg := pgoutbox.RelayConfig{FailoverReplay: time.Minute}
	relay := newRelay(t, pool, rec, cfg)
	drain := func() {
		for {
			res, err := relay.RelayBatch(ctx)
			require.NoError(t, err)
			if res.Claimed == 0 && countPending(t, pool, "") == 0 {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	drain()
	// Ten were written and dispatched long ago, five are shadow intents;
	// of the three the slow lane sent, one long ago.
	all := rowsWhere(t, pool, "")
	require.Len(t, all, 33)
	for _, r := range all[30:] {
		require.NotNil(t, r.DispatchedAt, "the slow lane marks what it sends")
	}
	updateWhere(t, pool, "created_at = created_at - interval '1 hour'", "id <= $1", all[9].ID)
	updateWhere(t, pool, "shadowed = true", "id BETWEEN $1 AND $2", all[25].ID, all[29].ID)
	updateWhere(t, pool, "created_at = created_at - interval '1 hour', dispatched_at = dispatched_at - interval '1 hour'", "id = $1", all[32].ID)

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
	require.EqualValues(t, 17, replays[0].Rows, "the dispatches in the window, both lanes', shadow intents left")
	require.Equal(t, 17, countPending(t, pool, ""))
	require.Zero(t, countPending(t, pool, "shadowed"))
	after, err := testTable.Timeline(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, replays[0].To, after.Timeline)
	require.NotNil(t, after.ReplayedRows)
	require.EqualValues(t, 17, *after.ReplayedRows)

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
	require.Equal(t, 17, again)

	// Turned off, a promotion replays nothing.
	promoted(t, pool)
	res, err = newRelay(t, pool, rec, pgoutbox.RelayConfig{FailoverReplay: -1}).CheckFailover(ctx)
	require.NoError(t, err)
	require.Zero(t, res)
}
