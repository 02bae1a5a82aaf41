package pgoutbox

// How the relay finds rows without marking each one (migration 00024).
//
// A long transaction anywhere on the server keeps every row version that
// died after it began. When the relay marked each dispatched row with an
// UPDATE, each dispatch left a dead tuple and a dead entry in the pending
// index, and each claim walked all of them again: with one report open the
// relay fell to a third of its rate within minutes. So rows are never
// updated to say they were dispatched. Each row carries tx, the
// transaction that wrote it, and the relay keeps one position per outbox
// table, a snapshot: the rows whose tx is visible in it have been passed
// (the batches by snapshot of PgQ and PgQue). A batch takes a new
// snapshot, cur, and works through the rows visible in cur and not in the
// position, in (tx, id) order, a page at a time; when the range is done,
// cur becomes the position. What a batch writes is its failures and one
// position row, whatever its size.
//
// Rows that need state of their own are marked slow and keep it in their
// columns as before: a failed publish (attempts, last_error, its backoff
// in available_at), a delay (available_at in the future), a row held
// behind an earlier pending row of its ordered aggregate. The slow lane
// claims them as the relay always claimed (FOR UPDATE SKIP LOCKED on a
// small partial index) and marks them dispatched. Rows written before
// migration 00024 have no tx and are relayed the same way.
//
// A row is pending when it is not dispatched_at and it is slow, has no tx,
// or has not been passed.

// PositionTable is the table (migration 00024) of the relay's position per
// outbox table.
const PositionTable = "ferry_relay_positions"

// startSnapshot is the position of an outbox table no relay has passed
// anything of yet: nothing is visible in it.
const startSnapshot = "1:1:"
