package pgretention_test

import (
	"context"
	"fmt"
	"slices"
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
	day, legacy := 24*time.Hour, -1
	var rows []pipelinetest.LedgerRow
	for g := 1; g <= 25; g++ {
		rows = append(rows, pipelinetest.LedgerRow{Consumer: "c", MessageID: fmt.Sprint("old-", g), ProcessedAt: time.Now().Add(-22 * day)})
	}
	for g := 1; g <= 5; g++ {
		rows = append(rows, pipelinetest.LedgerRow{Consumer: "c", MessageID: fmt.Sprint("new-", g), ProcessedAt: time.Now().Add(-13 * day)})
	}
	for g := 1; g <= 12; g++ {
		rows = append(rows, pipelinetest.LedgerRow{Consumer: "c", MessageID: fmt.Sprint("legacy-old-", g), ProcessedAt: time.Now().Add(-15 * day), Part: &legacy})
	}
	rows = append(rows, pipelinetest.LedgerRow{Consumer: "c", MessageID: "legacy-new", ProcessedAt: time.Now().Add(-day), Part: &legacy})
	pipelinetest.InsertLedger(t, pool, rows...)

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
	var all []string
	for _, r := range rows {
		all = append(all, r.MessageID)
	}
	pruned := pipelinetest.Unprocessed(t, pool, "c", all...)
	var left []string
	for _, id := range all {
		if !slices.Contains(pruned, id) {
			left = append(left, id)
		}
	}
	slices.Sort(left)
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
