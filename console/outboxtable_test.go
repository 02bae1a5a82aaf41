package console_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The test schema's outbox table (ferrytest.OutboxTable: CI runs these
// suites once with FERRY_TEST_OUTBOX_TABLE naming another table), for the
// tests' own SQL and reads; ferrytest.Schema reports a bad name.
var testTable, _ = ferrytest.OutboxTable()

var outboxSQL, archiveSQL = testTable.Quoted(), testTable.Archive()

// failingRows are n rows the relay keeps failing to publish on
// stripe.charge (aggregates prefix1…prefixn), next tried in ten minutes.
func failingRows(prefix string, n int) []pipelinetest.OutboxRow {
	rows := make([]pipelinetest.OutboxRow, n)
	for i := range rows {
		rows[i] = pipelinetest.OutboxRow{AggregateID: fmt.Sprint(prefix, i+1), Topic: "stripe.charge", Attempts: 3,
			LastError: "publishing to exchange x: NOT_FOUND", AvailableAt: time.Now().Add(10 * time.Minute)}
	}
	return rows
}

// dueRows counts topic's outbox rows due now and those waiting.
func dueRows(t *testing.T, pool *pgxpool.Pool, topic string) (due, waiting int) {
	t.Helper()
	rows, err := testTable.Rows(context.Background(), pool, pgoutbox.RowFilter{Topic: topic})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.AvailableAt.After(time.Now()) {
			waiting++
		} else {
			due++
		}
	}
	return due, waiting
}
