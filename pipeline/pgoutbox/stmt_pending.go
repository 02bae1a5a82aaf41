package pgoutbox

import "strings"

// The statements' catalogue, family "pending": the conditions that say
// what state an outbox row is in (see lanes.go). Every statement that asks
// whether a row is pending or dispatched is built from these, and so are
// the operator views (views.go); nothing outside the package sees them.

// sqlString is s as a SQL string literal: the outbox table's key, written
// into the reading queries so that they take no extra parameter.
func sqlString(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// latestPosition is the subquery of the newest position of t (alias it).
func (t Table) latestPosition() string {
	return `(SELECT * FROM ` + t.Positions() + ` WHERE outbox_table = ` + sqlString(t.Key()) + ` ORDER BY seq DESC LIMIT 1)`
}

// positionSnap is the expression of t's position snapshot: its newest
// row's, or startSnapshot when no relay has moved it yet.
func (t Table) positionSnap() string {
	return `coalesce((SELECT rp.snap FROM ` + t.latestPosition() + ` rp), '` + startSnapshot + `'::pg_snapshot)`
}

// slowCond is true of outbox row o when it is pending with state of its
// own: the slow lane's rows (its partial indexes' predicate).
func slowCond(o string) string {
	return o + `.dispatched_at IS NULL AND (` + o + `.slow OR ` + o + `.tx IS NULL)`
}

// passedCond is true of outbox row o when the relay's position has passed
// it: one primary-key lookup of the position per row, for reads of a few
// rows (a message's status, an intent, a test). Row o must have a tx.
func (t Table) passedCond(o string) string {
	return `EXISTS (SELECT 1 FROM ` + t.latestPosition() + ` rp
		WHERE (pg_visible_in_snapshot(` + o + `.tx, rp.snap)
		     OR (rp.cur IS NOT NULL AND pg_visible_in_snapshot(` + o + `.tx, rp.cur) AND (` + o + `.tx, ` + o + `.id) <= (rp.last_tx, rp.last_id))))`
}

// passedUnmarked is true of outbox row o when the position passed it and
// nothing marked it: a row sent at its first try by the append-only lane.
// extra, if set, is a further condition on o, written before the
// position's lookup so that it filters first.
func (t Table) passedUnmarked(o, extra string) string {
	if extra != "" {
		extra += ` AND `
	}
	return `(` + o + `.dispatched_at IS NULL AND NOT ` + o + `.slow AND ` + o + `.tx IS NOT NULL AND ` + extra + t.passedCond(o) + `)`
}

// unpassedRows selects the rows of rel (t or one of its partitions; alias
// o, columns as cols) that are not dispatched, not slow and not passed
// yet, by the tx index: those the position's snapshot did not see (in
// progress when it was taken, or newer), less those the batch in progress
// already passed.
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
func (t Table) unpassedRows(cols, rel string) string {
	pos := t.positionSnap()
	latest := t.latestPosition()
	field := func(c string) string { return `(SELECT rp.` + c + ` FROM ` + latest + ` rp)` }
	rest := `
		  AND o.dispatched_at IS NULL AND NOT o.slow
		  AND NOT coalesce(pg_visible_in_snapshot(o.tx, ` + field("cur") + `)
		       AND (o.tx, o.id) <= (` + field("last_tx") + `, ` + field("last_id") + `), false)`
	return `SELECT ` + cols + ` FROM ` + rel + ` o
		WHERE o.tx >= pg_snapshot_xmax(` + pos + `)
		  AND o.tx <= (SELECT max(m.tx) FROM ` + rel + ` m)` + rest + `
		UNION ALL
		SELECT ` + cols + ` FROM ` + rel + ` o
		WHERE o.tx = ANY(ARRAY(SELECT pg_snapshot_xip(` + pos + `)))` + rest
}

// pendingRowsOf is a subquery (alias it) of rel's pending rows (rel is t
// or one of its partitions) with columns cols (of alias o): the slow
// lane's, by its partial index, and those the relay has not passed yet,
// by the tx index. Every reader that asks what is pending reads through
// it, never dispatched_at alone.
func (t Table) pendingRowsOf(cols, rel string) string {
	return `(SELECT ` + cols + ` FROM ` + rel + ` o WHERE ` + slowCond("o") + `
		UNION ALL
		` + t.unpassedRows(cols, rel) + `)`
}

// pendingRows is pendingRowsOf the whole table.
func (t Table) pendingRows(cols string) string { return t.pendingRowsOf(cols, t.Quoted()) }

// dispatchedCond is true of outbox row o (alias) when it was dispatched:
// marked so (the slow lane, the CDC relay, shadow intents) or passed by
// the relay. Per row: for reads of a few rows.
func (t Table) dispatchedCond(o string) string {
	return `(` + o + `.dispatched_at IS NOT NULL OR (NOT ` + o + `.slow AND ` + o + `.tx IS NOT NULL AND ` + t.passedCond(o) + `))`
}
