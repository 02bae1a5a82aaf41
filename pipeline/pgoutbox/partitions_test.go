package pgoutbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// Go's week arithmetic and the migration's ferry_outbox_part agree, on
// both sides of the Monday the slot turns.
func TestPartitionOfMatchesTheMigration(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	monday := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)
	times := []time.Time{monday, monday.Add(-time.Second), monday.Add(time.Second), time.Unix(0, 0), time.Now()}
	for i := range 60 {
		times = append(times, monday.Add(time.Duration(i)*37*time.Hour))
	}
	for _, at := range times {
		var part int
		require.NoError(t, pool.QueryRow(ctx, `SELECT ferry_outbox_part($1)`, at).Scan(&part))
		require.Equal(t, part, pgweeks.Of(at), "at %s", at)
	}
	require.NotEqual(t, pgweeks.Of(monday), pgweeks.Of(monday.Add(-time.Second)), "the slot turns on Monday 00:00 UTC")
}

// insertAt writes an outbox row as if at time at: its week's partition
// and creation time. A zero at is now.
func insertAt(t *testing.T, pool *pgxpool.Pool, at time.Time, aggregate string, seq int, availableIn time.Duration) int64 {
	t.Helper()
	return pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{
		AggregateID: aggregate, Topic: "o", Payload: fmt.Sprintf(`{"seq":%d}`, seq), CreatedAt: at, AvailableAt: time.Now().Add(availableIn),
	})[0]
}

// A week past retention is emptied whole: its dispatched rows go with a
// TRUNCATE (no dead tuple), its pending rows (a delayed one, one the relay
// had not passed yet) move to the current week under their ids and are
// relayed once, in order with their aggregates' later rows. A lock on the
// outbox (a long transaction that read it) makes the partition wait, with
// nothing changed.
func TestClearPartitionsEmptiesPastRetentionWeeksAndKeepsPending(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	b := newBroker(t, "o")
	var order confirmedOrder
	rec := &recorder{Publisher: b.pub, after: order.record}
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"o"}}, pgoutbox.RelayConfig{FailoverReplay: -1})
	drain := func() {
		t.Helper()
		for range 100 {
			res, err := relay.RelayBatch(ctx)
			require.NoError(t, err)
			if res.Claimed == 0 && res.Passed == 0 {
				return
			}
		}
		t.Fatal("the relay kept finding work")
	}

	old := time.Now().Add(-6 * 7 * 24 * time.Hour)
	const sent = 100
	for i := range sent {
		insertAt(t, pool, old, "agg-"+string(rune('a'+i%5)), i, 0)
	}
	delayed := insertAt(t, pool, old, "agg-a", 1000, 3*time.Second)
	drain()
	unpassed := insertAt(t, pool, old, "agg-b", 1000, 0)
	behindDelayed := insertAt(t, pool, time.Time{}, "agg-a", 1001, 0)
	oldName := rowWhere(t, pool, "id = $1", delayed).Partition

	cutoff := time.Now().Add(-pgweeks.MaxRetention / 3)
	dry, err := testTable.ClearPartitions(ctx, pool, cutoff, false, true)
	require.NoError(t, err)
	require.Equal(t, pgoutbox.Cleared{Partitions: []string{oldName}, Rows: sent, Moved: 2}, dry)

	reader, err := pool.Begin(ctx)
	require.NoError(t, err)
	countWhere(t, reader, "")
	held, err := testTable.ClearPartitions(ctx, pool, cutoff, false, false)
	require.NoError(t, err)
	require.Empty(t, held.Partitions)
	require.Len(t, held.Waiting, 1)
	require.Contains(t, held.Waiting[0], oldName)
	require.NoError(t, reader.Rollback(ctx))
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+oldName).Scan(&n))
	require.Equal(t, sent+2, n, "a waiting partition is left as it was")

	done, err := testTable.ClearPartitions(ctx, pool, cutoff, false, false)
	require.NoError(t, err)
	require.Equal(t, pgoutbox.Cleared{Partitions: []string{oldName}, Rows: sent, Moved: 2}, done)
	var size int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), pg_relation_size($1::regclass) FROM `+oldName, oldName).Scan(&n, &size))
	require.Zero(t, n)
	require.Zero(t, size, "emptied by TRUNCATE: no page, so no dead tuple, left")
	for _, id := range []int64{delayed, unpassed, behindDelayed} {
		require.NotEqual(t, oldName, rowWhere(t, pool, "id = $1", id).Partition)
	}
	again, err := testTable.ClearPartitions(ctx, pool, cutoff, false, false)
	require.NoError(t, err)
	require.Equal(t, pgoutbox.Cleared{}, again, "an empty partition has nothing to clear")

	require.Eventually(t, func() bool {
		drain()
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return len(rec.published) >= sent+3
	}, 10*time.Second, 100*time.Millisecond)
	requireEachOnceInOrder(t, rec, sent+3, &order)
	require.Zero(t, countPending(t, pool, ""))
}
