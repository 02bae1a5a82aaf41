package pgoutbox

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/ferry-dev/ferry/pipeline"
)

// The statements' catalogue, family "page" and "position": the append-only
// lane's reads of a range and its moves of the position (see lanes.go).

// appendLane is the SQL of the relay's append-only lane (see lanes.go).
type appendLane struct {
	lockSQL, readSQL, snapSQL, moveSQL, slowSQL string
	// xipSQL pages the range's rows of the transactions that were in
	// progress when the position was taken; rangeSQL those of newer
	// transactions. Each is an ordered scan of the (tx, id) index that
	// stops at the page's end, however many rows the range holds and
	// however many rows older transactions wrote since a long one began.
	// (One query for both, with the in-progress ids read from the
	// snapshot in SQL, made the planner walk the index from the oldest
	// in-progress transaction on, filtering: with a long transaction
	// open, every page scanned all the rows since it began.)
	xipSQL, rangeSQL string
	// lockKeptSQL locks, by id, the rows of a page read without a lock
	// (xipSQL and rangeSQL are, when the relay has a MinAge) that are
	// old enough for the relay, and reads them again: @ids; when
	// ordered, @topics, @position and @range too. A row
	// dispatched or made slow since the page was read is not returned:
	// its writer has it.
	lockKeptSQL string
}

// newAppendLane builds the lane's SQL for outbox table t. lockLater: the
// relay has a MinAge (the CDC relay's safety net), so a page is read
// without a lock and only its rows old enough are locked, by
// lockKeptSQL. Locking the whole page, as without a MinAge, would hold the
// young rows the CDC relay is about to send for as long as the batch
// takes: it skips a locked row, and that row then waited for the safety
// net, MinAge later.
func newAppendLane(tbl Table, ordered, lockLater bool) appendLane {
	// Waits for a row another writer holds (a relay of the per-row design
	// during a rolling upgrade, the CDC relay): then reads it again, and
	// skips it if that writer dispatched it.
	lock := `
		FOR UPDATE OF o`
	pageLock := lock
	if lockLater {
		pageLock = ``
	}
	page := func(where string) string {
		return tbl.pageColumns(ordered) + `
		WHERE ` + where + `
		  AND pg_visible_in_snapshot(o.tx, @range::pg_snapshot)
		  AND o.dispatched_at IS NULL AND NOT o.slow
		ORDER BY o.tx, o.id
		LIMIT @limit` + pageLock
	}
	return appendLane{
		lockSQL: positionLockSQL,
		readSQL: tbl.positionReadSQL(),
		snapSQL: `SELECT pg_current_snapshot()::text`,
		moveSQL: tbl.positionMoveSQL(),
		slowSQL: tbl.markSlowSQL(),
		// The rows of the transactions that were in progress at the
		// position (@xip, an array the planner can use as an index
		// condition), from (@after_tx, @after_id) on.
		xipSQL: page(`o.tx = ANY(@xip::xid8[]) AND (o.tx, o.id) > (@after_tx::xid8, @after_id::bigint)`),
		// The newer transactions' rows, from (@after_tx, @after_id) on
		// (never below the position's xmax: appendPage sees to it), up to
		// the range's xmax. (None is one of @xip, all older: said so that
		// both queries take the same arguments.)
		rangeSQL: page(`(o.tx, o.id) > (@after_tx::xid8, @after_id::bigint) AND o.tx < pg_snapshot_xmax(@range::pg_snapshot) AND o.tx <> ALL(@xip::xid8[])`),
		lockKeptSQL: tbl.pageColumns(ordered) + `
		WHERE o.id = ANY(@ids::bigint[]) AND o.dispatched_at IS NULL AND NOT o.slow
		ORDER BY o.tx, o.id` + lock,
	}
}

func parseSnapshot(s string) (snapshot, error) {
	var sn snapshot
	bad := func(err error) (snapshot, error) {
		return snapshot{}, fmt.Errorf("the relay's position: snapshot %q: %w", s, err)
	}
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return bad(errors.New("not xmin:xmax:xip"))
	}
	var err error
	if sn.xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return bad(err)
	}
	if sn.xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return bad(err)
	}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return bad(err)
			}
			sn.xip = append(sn.xip, v)
		}
	}
	slices.Sort(sn.xip)
	return sn, nil
}

// snapshot is a pg_snapshot's text, "xmin:xmax:xip,...".
type snapshot struct {
	xmin, xmax uint64
	xip        []uint64 // ascending
}

// heldCond is the column that says whether row o of a page is held
// (@range the range's snapshot, @topics the ordered topics, @position the
// position's).
// Held: an earlier row of its ordered aggregate is pending with state of
// its own, or is in this range and not passed yet but comes after it in
// (tx, id) order (another transaction that took a smaller id and
// committed in the same range).
func (t Table) heldCond(ordered bool) string {
	if !ordered {
		return `false`
	}
	table := t.Quoted()
	return `(o.topic = ANY(@topics::text[]) AND (
	    EXISTS (SELECT 1 FROM ` + table + ` p
	        WHERE p.aggregate_id = o.aggregate_id AND ` + slowCond("p") + `
	          AND p.id < o.id AND p.topic = ANY(@topics::text[]))
	    OR EXISTS (SELECT 1 FROM ` + table + ` p
	        WHERE p.aggregate_id = o.aggregate_id AND p.tx > o.tx AND p.tx < pg_snapshot_xmax(@range::pg_snapshot)
	          AND pg_visible_in_snapshot(p.tx, @range::pg_snapshot) AND NOT pg_visible_in_snapshot(p.tx, @position::pg_snapshot)
	          AND p.id < o.id AND p.dispatched_at IS NULL AND NOT p.slow AND p.topic = ANY(@topics::text[]))))`
}

// pageColumns is the SELECT of a page's rows (scanPageRow). Due is read at
// the statement's start, not the transaction's (now()): a row committed
// before the range's snapshot was written by a transaction that began
// before this statement, so a row written without a delay is always due,
// never marked slow for a clock's sake.
func (t Table) pageColumns(ordered bool) string {
	return `SELECT o.id, o.message_uuid, o.aggregate_id, o.topic,
	       COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')), o.headers, o.attempts, o.created_at, COALESCE(o.due_at, o.created_at),
	       COALESCE(o.headers->>'` + pipeline.MetaShadow + `' = 'true', false),
	       o.tx::text, o.available_at <= statement_timestamp(), ` + t.heldCond(ordered) + `
	FROM ` + t.Quoted() + ` o`
}
