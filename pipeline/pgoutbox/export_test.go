package pgoutbox

// The statements' fragments, for this package's tests only: they check
// the rules themselves (the pending reads against the per-row condition,
// the plans), which the typed reads and views are built from.

// PendingOutbox is the default table's pending rows, every column (alias it).
var PendingOutbox = Table{}.pendingRows("o.*")

// DispatchedOutbox is true of row o of the default table when it was dispatched.
var DispatchedOutbox = Table{}.dispatchedCond("o")

// PendingRows is t's pending rows with columns cols (alias it).
func PendingRows(t Table, cols string) string { return t.pendingRows(cols) }
