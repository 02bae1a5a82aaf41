package pgoutbox

import (
	"strings"

	"github.com/jackc/pgx/v5"
)

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

// positionTable is PositionTable beside the outbox table, as timelineTable.
func positionTable(quotedOutbox string) string {
	t := pgx.Identifier{PositionTable}.Sanitize()
	if i := strings.LastIndex(quotedOutbox, `"."`); i >= 0 {
		return quotedOutbox[:i+1] + "." + t
	}
	return t
}

// latestPosition is the subquery of the newest position of key (alias it).
func latestPosition(quotedOutbox, key string) string {
	return `(SELECT * FROM ` + positionTable(quotedOutbox) + ` WHERE outbox_table = ` + sqlString(key) + ` ORDER BY seq DESC LIMIT 1)`
}

// positionSnap is the expression of key's position snapshot: its newest
// row's, or startSnapshot when no relay has moved it yet.
func positionSnap(quotedOutbox, key string) string {
	return `coalesce((SELECT rp.snap FROM ` + latestPosition(quotedOutbox, key) + ` rp), '` + startSnapshot + `'::pg_snapshot)`
}

// sqlString is s as a SQL string literal: the outbox table's name, written
// into the reading queries so that they take no extra parameter.
func sqlString(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// tableKey is the outbox table's row in PositionTable: its name as
// configured ("" is DefaultTable).
func tableKey(table string) string {
	if table == "" {
		return DefaultTable
	}
	return table
}

// slowCond is true of outbox row o when it is pending with state of its
// own: the slow lane's rows (its partial indexes' predicate).
func slowCond(o string) string {
	return o + `.dispatched_at IS NULL AND (` + o + `.slow OR ` + o + `.tx IS NULL)`
}

// passedCond is true of outbox row o when the relay's position has passed
// it: one primary-key lookup of the position per row, for reads of a few
// rows (a message's status, an intent, a test). Row o must have a tx.
func passedCond(o, quotedOutbox, key string) string {
	return `EXISTS (SELECT 1 FROM ` + latestPosition(quotedOutbox, key) + ` rp
		WHERE (pg_visible_in_snapshot(` + o + `.tx, rp.snap)
		     OR (rp.cur IS NOT NULL AND pg_visible_in_snapshot(` + o + `.tx, rp.cur) AND (` + o + `.tx, ` + o + `.id) <= (rp.last_tx, rp.last_id))))`
}

// unpassedRows selects the rows (alias o, columns as cols) that are not
// dispatched, not slow and not passed yet, by the tx index: those the
// position's snapshot did not see (in progress when it was taken, or
// newer), less those the batch in progress already passed.
//
// Two branches, each an index condition on tx, never one OR of both: the
// position is read at run time, so the planner takes "tx >= xmax" for a
// third of the table, and with the OR, a filter on the rows (topic =
// 'ferry.retry', as the retry gauges read) made it scan every partition
// whole instead: 100 ms for 300,000 passed rows, every 15 s, growing with
// the 30 days the outbox keeps. The newer rows' range is closed above by
// a run-time value too, the table's highest tx (one index probe per
// partition), which makes the planner take the range for a small one (its
// default for a range of two run-time bounds) and read it by the index,
// however many rows the partitions keep. Not the snapshot's xmax: the
// caller's own transaction id may be above it (its rows count as pending
// to it), and so may the rows of a database restored into a cluster whose
// ids are behind its dump's.
//
// Neither branch's rows are visible in the position's snapshot, so what
// may have passed them is the batch in progress: its range's snapshot
// (cur) and the last row it passed, read once for the statement (scalar
// subqueries of no row: the planner runs each once, an InitPlan). Not
// passedCond, which the planner joins to every row (an anti-join over the
// position's subquery): 16 ms against 11 ms for 40,000 rows not passed,
// on every metrics scrape while a relay is behind.
func unpassedRows(cols, quotedOutbox, key string) string {
	pos := positionSnap(quotedOutbox, key)
	latest := latestPosition(quotedOutbox, key)
	field := func(c string) string { return `(SELECT rp.` + c + ` FROM ` + latest + ` rp)` }
	rest := `
		  AND o.dispatched_at IS NULL AND NOT o.slow
		  AND NOT coalesce(pg_visible_in_snapshot(o.tx, ` + field("cur") + `)
		       AND (o.tx, o.id) <= (` + field("last_tx") + `, ` + field("last_id") + `), false)`
	return `SELECT ` + cols + ` FROM ` + quotedOutbox + ` o
		WHERE o.tx >= pg_snapshot_xmax(` + pos + `)
		  AND o.tx <= (SELECT max(m.tx) FROM ` + quotedOutbox + ` m)` + rest + `
		UNION ALL
		SELECT ` + cols + ` FROM ` + quotedOutbox + ` o
		WHERE o.tx = ANY(ARRAY(SELECT pg_snapshot_xip(` + pos + `)))` + rest
}

// PendingRows is a subquery (alias it) of the outbox table's pending rows
// with columns cols (of alias o): the slow lane's, by its partial index,
// and those the relay has not passed yet, by the tx index. Every reader
// that asks what is pending reads through it, never dispatched_at alone.
func PendingRows(cols, quotedOutbox, table string) string {
	key := tableKey(table)
	return `(SELECT ` + cols + ` FROM ` + quotedOutbox + ` o WHERE ` + slowCond("o") + `
		UNION ALL
		` + unpassedRows(cols, quotedOutbox, key) + `)`
}

// DispatchedCond is true of outbox row o (alias) when it was dispatched:
// marked so (the slow lane, the CDC relay, shadow intents) or passed by
// the relay. Per row: for reads of a few rows.
func DispatchedCond(o, quotedOutbox, table string) string {
	return `(` + o + `.dispatched_at IS NOT NULL OR (NOT ` + o + `.slow AND ` + o + `.tx IS NOT NULL AND ` + passedCond(o, quotedOutbox, tableKey(table)) + `))`
}

// PendingOutbox is PendingRows of the default outbox table with all its
// columns, for tests and tools: `SELECT count(*) FROM ` + PendingOutbox + ` o`.
var PendingOutbox = PendingRows("o.*", `"outbox"`, DefaultTable)

// DispatchedOutbox is DispatchedCond of row o of the default outbox table.
var DispatchedOutbox = DispatchedCond("o", `"outbox"`, DefaultTable)
