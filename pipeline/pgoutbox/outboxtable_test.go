package pgoutbox_test

import (
	"github.com/ferry-dev/ferry/ferrytest"
)

// The test schema's outbox table (ferrytest.OutboxTable: CI runs this
// suite once with FERRY_TEST_OUTBOX_TABLE naming another table), for the
// tests' own SQL and reads; ferrytest.Schema reports a bad name.
var testTable, _ = ferrytest.OutboxTable()

var outboxSQL, archiveSQL = testTable.Quoted(), testTable.Archive()
