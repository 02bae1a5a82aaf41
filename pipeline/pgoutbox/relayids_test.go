package pgoutbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// insertRow writes one outbox row of payload {"n":1} and returns its id.
func insertRow(t *testing.T, pool *pgxpool.Pool, r pipelinetest.OutboxRow) int64 {
	t.Helper()
	r.Payload = `{"n":1}`
	return pipelinetest.InsertOutbox(t, pool, testTable, r)[0]
}

type rowState struct {
	Dispatched bool
	Attempts   int
	Shadowed   bool
}

func stateOf(t *testing.T, pool *pgxpool.Pool, id int64) rowState {
	t.Helper()
	r := rowWhere(t, pool, "id = $1", id)
	return rowState{Dispatched: r.Dispatched, Attempts: r.Attempts, Shadowed: r.Shadowed}
}

// RelayIDs (the CDC relay's way in) keeps the polling relay's rules:
// delayed rows, rows another relay holds and rows behind a pending head of
// their ordered aggregate are left pending, and so is every later row of
// an aggregate so left; dispatched rows are skipped, shadow intents
// shadowed, the rest published and marked dispatched.
func TestRelayIDsKeepsThePollingRelaysRules(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "o", "u")
	rec := &recorder{Publisher: b.pub}
	relay := newRelay(t, pool, orderedRecorder{recorder: rec, ordered: []string{"o"}}, pgoutbox.RelayConfig{})
	ctx := context.Background()

	head := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "held"})         // locked by another relay below
	behindLocked := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "held"}) // behind it
	delayed := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "late", AvailableAt: time.Now().Add(time.Hour)})
	behindDelayed := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "late"})
	outsideHead := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "outside"}) // pending, not in the ids
	behindOutside := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "outside"})
	done := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "x", Dispatched: true})
	shadow := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "x", Headers: map[string]string{"shadow_mode": "true"}})
	first := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "free"})
	second := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "free"}) // same aggregate: a later wave
	plain := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "y"})

	other, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx)
	lockRows(t, other, "id = $1", head)

	const gone = 1 << 40 // no such row: deleted, or not yet visible
	res, err := relay.RelayIDs(ctx, []int64{head, behindLocked, delayed, behindDelayed, behindOutside, done, shadow, first, second, plain, gone})
	require.NoError(t, err)
	require.Equal(t, pgoutbox.BatchResult{Claimed: 4, Dispatched: 3, Shadowed: 1, Left: 5, Skipped: 1, Missing: []int64{gone}}, res)
	for _, id := range []int64{head, behindLocked, delayed, behindDelayed, outsideHead, behindOutside} {
		require.Equal(t, rowState{}, stateOf(t, pool, id), "row %d must be left untouched", id)
	}
	require.Equal(t, rowState{Dispatched: true, Shadowed: true}, stateOf(t, pool, shadow))
	for _, id := range []int64{first, second, plain} {
		require.Equal(t, rowState{Dispatched: true, Attempts: 1}, stateOf(t, pool, id))
	}
	require.Len(t, rec.published, 3)
}

// A row whose publish fails while others are confirmed is recorded as the
// polling relay records it (attempts, last_error, backoff) and the later
// rows of its ordered aggregate are not sent; when the broker confirms
// nothing, nothing is recorded and the answer is ErrNothingConfirmed.
func TestRelayIDsFailures(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "o", "u")
	failing := map[string]bool{}
	rec := &recorder{Publisher: b.pub, before: func(m *message.Message) error {
		if failing[m.Metadata.Get("aggregate_id")] {
			return errors.New("injected publish failure")
		}
		return nil
	}}
	relay := newRelay(t, pool, orderedRecorder{recorder: rec, ordered: []string{"o"}}, pgoutbox.RelayConfig{})
	ctx := context.Background()

	bad := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "bad"})
	afterBad := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "o", AggregateID: "bad"})
	good := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "good"})
	failing["bad"] = true
	res, err := relay.RelayIDs(ctx, []int64{bad, afterBad, good})
	require.NoError(t, err)
	require.Equal(t, pgoutbox.BatchResult{Claimed: 3, Dispatched: 1, Failed: 1, Left: 1}, res)
	failed := rowWhere(t, pool, "id = $1", bad)
	require.Equal(t, 1, failed.Attempts)
	require.Contains(t, failed.LastError, "injected publish failure")
	require.True(t, failed.AvailableAt.After(time.Now()))
	require.Equal(t, rowState{}, stateOf(t, pool, afterBad), "a later row of a failed ordered aggregate is not sent")

	failing["good2"] = true
	good2 := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "good2"})
	_, err = relay.RelayIDs(ctx, []int64{good2})
	require.ErrorIs(t, err, pgoutbox.ErrNothingConfirmed)
	require.Equal(t, rowState{}, stateOf(t, pool, good2), "an outage records nothing")
}

// The CDC relay's safety net (a relay with a MinAge) never holds a row
// younger than its MinAge, even for a moment: the CDC relay skips a row
// another relay holds, and a young row so skipped waited MinAge for the
// safety net. Here the safety net's batch waits on an old row another
// transaction holds, behind a young row in (tx, id) order; the CDC
// relay's call for the young row, meanwhile, sends it.
func TestSafetyNetLeavesYoungRowsToTheCDCRelay(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "u")
	rec := &recorder{Publisher: b.pub}
	net := newRelay(t, pool, rec, pgoutbox.RelayConfig{MinAge: time.Hour})
	cdc := newRelay(t, pool, rec, pgoutbox.RelayConfig{})
	ctx := context.Background()

	old := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "a", CreatedAt: time.Now().Add(-2 * time.Hour)})
	young := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "b"})
	// Committed after young, written as if two hours ago: after young in
	// the lane's order, and old enough for the safety net.
	oldAfter := insertRow(t, pool, pipelinetest.OutboxRow{Topic: "u", AggregateID: "c", CreatedAt: time.Now().Add(-2 * time.Hour)})

	other, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx)
	var otherPID int
	require.NoError(t, other.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&otherPID))
	lockRows(t, other, "id = $1", oldAfter)

	type batch struct {
		res pgoutbox.BatchResult
		err error
	}
	done := make(chan batch, 1)
	go func() {
		res, err := net.RelayBatch(ctx)
		done <- batch{res, err}
	}()
	// The batch either finishes or waits on oldAfter's lock; either way
	// the CDC relay's call comes while the batch has done what it does
	// before that.
	var first *batch
	require.Eventually(t, func() bool {
		select {
		case b := <-done:
			first = &b
			return true
		default:
		}
		var waiting bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))`, otherPID).Scan(&waiting))
		return waiting
	}, 10*time.Second, 10*time.Millisecond)

	res, err := cdc.RelayIDs(ctx, []int64{young})
	require.NoError(t, err)
	require.Equal(t, 1, res.Dispatched, "the young row is the CDC relay's to send: %+v", res)
	require.Zero(t, res.Left, "the safety net held the young row")

	require.NoError(t, other.Rollback(ctx))
	if first == nil {
		b := <-done
		first = &b
	}
	require.NoError(t, first.err)
	require.Equal(t, 1, first.res.Dispatched, "the safety net sent the old row before the young one, and stopped there: %+v", first.res)
	require.True(t, stateOf(t, pool, old).Dispatched)

	// young is sent: the lane goes on to the old row behind it.
	res, err = net.RelayBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Dispatched, "%+v", res)
	for _, id := range []int64{old, young, oldAfter} {
		require.True(t, stateOf(t, pool, id).Dispatched, "row %d", id)
	}
	require.Len(t, rec.published, 3)
}
