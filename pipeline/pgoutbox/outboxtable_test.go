package pgoutbox_test

import (
	"testing"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// The test schema's outbox table (ferrytest.OutboxTable: CI runs this
// suite once with FERRY_TEST_OUTBOX_TABLE naming another table), for the
// tests' own SQL and reads; ferrytest.Schema reports a bad name.
var testTable, _ = ferrytest.OutboxTable()

var outboxSQL, archiveSQL = testTable.Quoted(), testTable.Archive()

// requireDefaultOutbox skips a test of Ferry's own migrations, which make
// and change the table "outbox", when the suite runs with the outbox
// renamed (FERRY_TEST_OUTBOX_TABLE); it runs in the suite under the
// default name, which CI runs too.
func requireDefaultOutbox(t *testing.T) {
	t.Helper()
	if testTable.Name() != pgoutbox.DefaultTable {
		t.Skipf("migrates the table %q itself: run without FERRY_TEST_OUTBOX_TABLE", pgoutbox.DefaultTable)
	}
}
