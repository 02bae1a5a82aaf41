package pgoutbox_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

var update = flag.Bool("update", false, "rewrite migration 00027 from Table.ViewsDDL")

const viewsMigration = "00027_outbox_views.sql"

// viewsMigrationText is what migration 00027 holds: the default table's
// views, as pgoutbox builds them.
func viewsMigrationText() string {
	var b strings.Builder
	b.WriteString(`-- +goose Up
-- Operator views: one per row state (pgoutbox/views.go). A row sent at its
-- first try keeps dispatched_at NULL (the relay's position passes it), so
-- "WHERE dispatched_at IS NULL" counts every row ever relayed as pending:
-- SELECT count(*) FROM ferry_outbox_pending gives what ferry status gives.
-- Generated from pgoutbox.Table.ViewsDDL: edit that, then run
-- go test ./pipeline/pgoutbox/ -run TestViewsMigrationIsTheViewsDDL -update
`)
	for _, stmt := range (pgoutbox.Table{}).ViewsDDL() {
		b.WriteString("-- +goose StatementBegin\n" + stmt + ";\n-- +goose StatementEnd\n")
	}
	b.WriteString("\n-- +goose Down\n")
	for i := len(pgoutbox.RowStates) - 1; i >= 0; i-- {
		b.WriteString("DROP VIEW IF EXISTS " + (pgoutbox.Table{}).View(pgoutbox.RowStates[i]) + ";\n")
	}
	return b.String()
}

// The migration holds exactly the views pgoutbox builds: an operator's
// count over a view agrees with the relay's rules.
func TestViewsMigrationIsTheViewsDDL(t *testing.T) {
	path := "../../migrations/" + viewsMigration
	want := viewsMigrationText()
	if *update {
		require.NoError(t, os.WriteFile(path, []byte(want), 0o644))
	}
	got, err := migrations.FS.ReadFile(viewsMigration)
	require.NoError(t, err)
	require.Equal(t, want, string(got), "migration %s differs from pgoutbox.Table.ViewsDDL: run this test with -update", viewsMigration)
}

// Each view counts what the typed reads count, on an outbox holding rows
// in every state, and EnsureViews gives an outbox of another name the
// same views.
func TestViewsAgreeWithTheTypedReads(t *testing.T) {
	pool := ferrytest.Postgres(t)
	ctx := context.Background()
	tbl := testTable
	// Pending new rows, one delayed, one failing, one durable retry.
	var rows []pipelinetest.OutboxRow
	for g := range 5 {
		rows = append(rows, pipelinetest.OutboxRow{AggregateID: fmt.Sprint(g + 1), Topic: "views.t"})
	}
	rows = append(rows,
		pipelinetest.OutboxRow{AggregateID: "d", Topic: "views.t", AvailableAt: time.Now().Add(time.Hour)},
		pipelinetest.OutboxRow{AggregateID: "f", Topic: "views.t", Slow: true, Attempts: 2, LastError: "broker said no"},
		pipelinetest.OutboxRow{AggregateID: "r", Topic: pipeline.RetryTopic, Headers: map[string]string{"ferry_retry_queue": "h"}},
		// One marked dispatched.
		pipelinetest.OutboxRow{AggregateID: "x", Topic: "views.t", Slow: true, Dispatched: true, Attempts: 1})
	pipelinetest.InsertOutbox(t, pool, tbl, rows...)

	count := func(view string) int64 {
		var n int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+view).Scan(&n))
		return n
	}
	pending, err := tbl.PendingCount(ctx, pool)
	require.NoError(t, err)
	require.EqualValues(t, 8, pending)
	require.Equal(t, pending, count(tbl.View(pgoutbox.StatePending)))
	require.EqualValues(t, 1, count(tbl.View(pgoutbox.StateFailing)))
	_, total, err := tbl.RetryGroups(ctx, pool, 10)
	require.NoError(t, err)
	require.EqualValues(t, total, count(tbl.View(pgoutbox.StateRetrying)))
	require.EqualValues(t, 1, count(tbl.View(pgoutbox.StateDispatched)))

	// Rows agrees: every row without a filter, each with its state.
	all, err := tbl.Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	require.Len(t, all, 9, "an empty filter chooses every row")
	dispatched := 0
	for _, r := range all {
		if r.Dispatched {
			dispatched++
			require.Equal(t, "x", r.AggregateID)
		}
	}
	require.Equal(t, 1, dispatched)
	notYet := true
	ofTopic, err := tbl.Rows(ctx, pool, pgoutbox.RowFilter{Pending: &notYet, Topic: "views.t"})
	require.NoError(t, err)
	require.Len(t, ofTopic, 7, "the pending rows of one topic")

	// Another table of the same shape gets views of its own.
	_, err = pool.Exec(ctx, `CREATE TABLE events (LIKE `+outboxSQL+` INCLUDING ALL)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO events SELECT * FROM `+outboxSQL)
	require.NoError(t, err)
	events, err := pgoutbox.ParseTable("events")
	require.NoError(t, err)
	require.NoError(t, events.EnsureViews(ctx, pool))
	require.NoError(t, events.EnsureViews(ctx, pool), "EnsureViews is idempotent")
	require.Equal(t, pending, count(events.View(pgoutbox.StatePending)))
	require.EqualValues(t, 1, count(`ferry_events_failing`))
}
