package pgretention_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A week of the ledger past retention goes whole; the legacy partition
// (the table before the upgrade to partitions) row by row, in batches.
func TestPruneLedgerRemovesOnlyOldRows(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO processed_messages (consumer, message_id, processed_at, part)
		SELECT 'c', 'old-' || g, now() - interval '22 days', ferry_outbox_part(now() - interval '22 days') FROM generate_series(1, 25) g
		UNION ALL SELECT 'c', 'new-' || g, now() - interval '13 days', ferry_outbox_part(now() - interval '13 days') FROM generate_series(1, 5) g
		UNION ALL SELECT 'c', 'legacy-old-' || g, now() - interval '15 days', -1 FROM generate_series(1, 12) g
		UNION ALL SELECT 'c', 'legacy-new', now() - interval '1 day', -1`)
	require.NoError(t, err)

	dry, err := pgretention.Prune(ctx, pool, pgretention.Ledger, pgretention.Options{Table: testTable, OlderThan: pgretention.DefaultLedgerRetention, DryRun: true, BatchSize: 10})
	require.NoError(t, err)
	require.EqualValues(t, 37, dry.Removed)
	require.Equal(t, 2, dry.Batches, "a dry run says how many batches the real run takes")
	require.Len(t, dry.Partitions.Partitions, 1)

	res, err := pgretention.Prune(ctx, pool, pgretention.Ledger, pgretention.Options{Table: testTable, OlderThan: pgretention.DefaultLedgerRetention, BatchSize: 10})
	require.NoError(t, err)
	require.EqualValues(t, 37, res.Removed)
	require.Equal(t, 2, res.Batches, "the legacy partition's 10 + 2")
	require.Equal(t, dry.Partitions.Partitions, res.Partitions.Partitions, "25 rows in one week, emptied whole")
	var left []string
	rows, err := pool.Query(ctx, `SELECT message_id FROM processed_messages ORDER BY message_id`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		left = append(left, id)
	}
	require.Equal(t, []string{"legacy-new", "new-1", "new-2", "new-3", "new-4", "new-5"}, left)
}

// Rows are written into their week's partition (part, as the column's
// default does); the legacy partition holds the rows of before the
// upgrade to partitions.
func TestPruneOutboxKeepsPendingAndRecentRows(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	old, recent, legacy := time.Now().Add(-40*24*time.Hour), time.Now().Add(-24*time.Hour), -1
	sent := func(aggregate string, at time.Time, part *int) pipelinetest.OutboxRow {
		return pipelinetest.OutboxRow{AggregateID: aggregate, Topic: "t", CreatedAt: at, Dispatched: true, DispatchedAt: at, Part: part}
	}
	pipelinetest.InsertOutbox(t, pool, testTable,
		sent("old-dispatched", old, nil),
		pipelinetest.OutboxRow{AggregateID: "old-pending", Topic: "t", CreatedAt: old},
		sent("legacy-old", old, &legacy),
		sent("legacy-recent", recent, &legacy),
		sent("new-dispatched", recent, nil))

	dry, err := pgretention.Prune(ctx, pool, pgretention.Outbox, pgretention.Options{Table: testTable, OlderThan: pgretention.DefaultOutboxRetention, DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 2, dry.Removed)
	require.NotNil(t, dry.Partitions)
	require.Len(t, dry.Partitions.Partitions, 1)
	require.EqualValues(t, 1, dry.Partitions.Moved)

	res, err := pgretention.Prune(ctx, pool, pgretention.Outbox, pgretention.Options{Table: testTable, OlderThan: pgretention.DefaultOutboxRetention, Archive: true})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Removed, "the old week's dispatched row whole, the legacy partition's old row by row")
	require.Len(t, res.Partitions.Partitions, 1)
	require.EqualValues(t, 1, res.Partitions.Moved, "the pending row moved to the current week")
	var kept, archived []string
	rows, err := testTable.Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	for _, r := range rows {
		kept = append(kept, r.AggregateID)
	}
	// The archive has no reader of its own but SQL: it is the operators'.
	arch, err := pool.Query(ctx, `SELECT aggregate_id FROM `+archiveSQL+` ORDER BY id`)
	require.NoError(t, err)
	archived, err = pgx.CollectRows(arch, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"old-pending", "legacy-recent", "new-dispatched"}, kept, "a pending row is never pruned, however old")
	require.Equal(t, []string{"old-dispatched", "legacy-old"}, archived)

	_, err = pgretention.Prune(ctx, pool, pgretention.Outbox, pgretention.Options{Table: testTable, OlderThan: 200 * 24 * time.Hour})
	require.ErrorContains(t, err, "longer than its partitions serve")
	_, err = pgretention.Prune(ctx, pool, pgretention.Ledger, pgretention.Options{Table: testTable, OlderThan: time.Hour, Archive: true})
	require.Error(t, err, "only the outbox has an archive")
	_, err = pgretention.Prune(ctx, pool, pgretention.Outbox, pgretention.Options{Table: testTable})
	require.Error(t, err, "a retention is required")
}
