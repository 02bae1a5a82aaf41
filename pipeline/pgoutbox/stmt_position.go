package pgoutbox

// The statements' catalogue, family "position": the append-only lane's
// position per outbox table (see lanes.go).

import (
	"fmt"
	"time"
)

// positionLockSQL takes the position of outbox table $1 (its quoted name)
// for this batch, without waiting. One relay at a time moves an outbox
// table's position: a transaction-level advisory lock, taken without
// waiting, writes nothing (a locked row would be a write per batch).
// Advisory locks are the database's, not a schema's: the key is the
// table's oid, so that services with an outbox of the same name in schemas
// of their own never wait for each other.
//
// The same statement turns sorting off for the rest of the batch's
// transaction: a page must walk the (tx, id) index of each partition in
// order (a Merge Append) and stop at LIMIT. On a partition not analyzed
// yet (a new week, autovacuum not there yet) the planner, taking it for a
// few rows, sorted every unpassed row for each page instead: 4x slower.
const positionLockSQL = `SELECT pg_try_advisory_xact_lock(hashtext('` + PositionTable + `'), hashtext($1::regclass::oid::text)), set_config('enable_sort', 'off', true)`

// positionWaitSQL is positionLockSQL that waits for the lock, at most
// bound (lock_timeout, set first in the same round trip: a query of the
// simple protocol, pgx.QueryExecModeSimpleProtocol, may carry two
// statements).
func positionWaitSQL(bound time.Duration) string {
	return fmt.Sprintf(`SET LOCAL lock_timeout = %d; SELECT pg_advisory_xact_lock(hashtext('`+PositionTable+`'), hashtext($1::regclass::oid::text)), set_config('enable_sort', 'off', true)`, bound.Milliseconds())
}

// positionReadSQL reads the newest position of the key $1.
func (t Table) positionReadSQL() string {
	return `SELECT snap::text, cur::text, last_tx::text, last_id, seq FROM ` + t.Positions() + ` WHERE outbox_table = $1 ORDER BY seq DESC LIMIT 1`
}

// positionMoveSQL moves the position of the key @key to (@snap, @cur,
// @last_tx, @last_id), @seq the seq of the row read. A move is a new
// row; every thousandth move removes the rows a thousand moves behind,
// which no reader reaches any more. Its moved_at is the clock after the
// range's snapshot was taken: every row the position passed was written
// before it.
//
// The removal looks only at the rows from 3,000 below the newest row read
// (@seq) on: while a long transaction holds the horizon, the rows removed
// before stay in the index as dead entries, and a removal from the table's
// first row walked them all (68 ms per thousandth move after 168,000
// moves, growing with the hold). Rows a narrow removal misses (a move's
// seq taken by a rolled-back batch or by another outbox table's relay) go
// with every hundred-thousandth move's, which looks from the first row.
func (t Table) positionMoveSQL() string {
	p := t.Positions()
	return `WITH moved AS (
			INSERT INTO ` + p + ` (outbox_table, snap, cur, last_tx, last_id, moved_at) VALUES (@key, @snap::pg_snapshot, @cur::pg_snapshot, @last_tx::xid8, @last_id, clock_timestamp()) RETURNING seq)
			DELETE FROM ` + p + ` WHERE outbox_table = @key AND (SELECT seq FROM moved) % 1000 = 0 AND seq < (SELECT seq FROM moved) - 1000
				AND seq >= CASE WHEN (SELECT seq FROM moved) % 100000 = 0 THEN 0 ELSE @seq::bigint - 3000 END`
}
