package pgoutbox

import "os"

// The statements' fragments, for this package's tests only: they check
// the rules themselves (the pending reads against the per-row condition,
// the plans), which the typed reads and views are built from.

// testTable is the test schema's outbox table (ferrytest.OutboxTable,
// which this package's own tests cannot import).
var testTable, _ = ParseTable(os.Getenv("FERRY_TEST_OUTBOX_TABLE"))

// PendingOutbox is the test table's pending rows, every column (alias it).
var PendingOutbox = testTable.pendingRows("o.*")

// DispatchedOutbox is true of row o of the test table when it was dispatched.
var DispatchedOutbox = testTable.dispatchedCond("o")

// PendingRows is t's pending rows with columns cols (alias it).
func PendingRows(t Table, cols string) string { return t.pendingRows(cols) }
