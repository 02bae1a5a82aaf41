package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
)

// fastLane is the SQL of the relay's append-only lane (see lanes.go).
type fastLane struct {
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
	// old enough for the relay, and reads them again: $1 the ids; when
	// ordered, $2 the ordered topics, $3 the position and $4 the range's
	// snapshot (unordered, the query has no use for them). A row
	// dispatched or made slow since the page was read is not returned:
	// its writer has it.
	lockKeptSQL string
}

// newFastLane builds the lane's SQL for outbox table t. lockLater: the
// relay has a MinAge (the CDC relay's safety net), so a page is read
// without a lock and only its rows old enough are locked, by
// lockKeptSQL. Locking the whole page, as without a MinAge, would hold the
// young rows the CDC relay is about to send for as long as the batch
// takes: it skips a locked row, and that row then waited for the safety
// net, MinAge later.
func newFastLane(t string, ordered, lockLater bool) fastLane {
	p := positionTable(t)
	// behind is the column that says whether row o is held; snap is the
	// range's snapshot, topics the ordered topics, pos the position.
	behind := func(snap, topics, pos string) string {
		if !ordered {
			return `false`
		}
		// Held: an earlier row of its ordered aggregate is pending with
		// state of its own, or is in this range and not passed yet but
		// comes after it in (tx, id) order (another transaction that took
		// a smaller id and committed in the same range).
		return `(o.topic = ANY(` + topics + `::text[]) AND (
		    EXISTS (SELECT 1 FROM ` + t + ` p
		        WHERE p.aggregate_id = o.aggregate_id AND ` + slowCond("p") + `
		          AND p.id < o.id AND p.topic = ANY(` + topics + `::text[]))
		    OR EXISTS (SELECT 1 FROM ` + t + ` p
		        WHERE p.aggregate_id = o.aggregate_id AND p.tx > o.tx AND p.tx < pg_snapshot_xmax(` + snap + `::pg_snapshot)
		          AND pg_visible_in_snapshot(p.tx, ` + snap + `::pg_snapshot) AND NOT pg_visible_in_snapshot(p.tx, ` + pos + `::pg_snapshot)
		          AND p.id < o.id AND p.dispatched_at IS NULL AND NOT p.slow AND p.topic = ANY(` + topics + `::text[]))))`
	}
	// Due is read at the statement's start, not the transaction's
	// (now()): a row committed before the range's snapshot was written by
	// a transaction that began before this statement, so a row written
	// without a delay is always due, never marked slow for a clock's
	// sake.
	columns := func(snap, topics, pos string) string {
		return `SELECT o.id, o.message_uuid, o.aggregate_id, o.topic,
		       COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')), o.headers, o.attempts, o.created_at, COALESCE(o.due_at, o.created_at),
		       COALESCE(o.headers->>'` + pipeline.MetaShadow + `' = 'true', false),
		       o.tx::text, o.available_at <= statement_timestamp(), ` + behind(snap, topics, pos) + `
		FROM ` + t + ` o`
	}
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
		return columns("$1", "$6", "$7") + `
		WHERE ` + where + `
		  AND pg_visible_in_snapshot(o.tx, $1::pg_snapshot)
		  AND o.dispatched_at IS NULL AND NOT o.slow
		ORDER BY o.tx, o.id
		LIMIT $4` + pageLock
	}
	return fastLane{
		// One relay at a time moves an outbox table's position: a
		// transaction-level advisory lock, taken without waiting, writes
		// nothing (a locked row would be a write per batch). Advisory
		// locks are the database's, not a schema's: the key is the
		// table's oid, so that services with an outbox of the same name
		// in schemas of their own never wait for each other.
		//
		// The same statement turns sorting off for the rest of the
		// batch's transaction: a page must walk the (tx, id) index of
		// each partition in order (a Merge Append) and stop at LIMIT. On
		// a partition not analyzed yet (a new week, autovacuum not there
		// yet) the planner, taking it for a few rows, sorted every
		// unpassed row for each page instead: 4x slower.
		lockSQL: `SELECT pg_try_advisory_xact_lock(hashtext('` + PositionTable + `'), hashtext($1::regclass::oid::text)), set_config('enable_sort', 'off', true)`,
		readSQL: `SELECT snap::text, cur::text, last_tx::text, last_id, seq FROM ` + p + ` WHERE outbox_table = $1 ORDER BY seq DESC LIMIT 1`,
		snapSQL: `SELECT pg_current_snapshot()::text`,
		// A move is a new row; every thousandth move removes the rows a
		// thousand moves behind, which no reader reaches any more. Its
		// moved_at is the clock after the range's snapshot was taken: every
		// row the position passed was written before it.
		//
		// The removal looks only at the rows from 3,000 below the newest
		// row read ($6) on: while a long transaction holds the horizon,
		// the rows removed before stay in the index as dead entries, and a
		// removal from the table's first row walked them all (68 ms per
		// thousandth move after 168,000 moves, growing with the hold).
		// Rows a narrow removal misses (a move's seq taken by a rolled-back
		// batch or by another outbox table's relay) go with every
		// hundred-thousandth move's, which looks from the first row.
		moveSQL: `WITH moved AS (
			INSERT INTO ` + p + ` (outbox_table, snap, cur, last_tx, last_id, moved_at) VALUES ($1, $2::pg_snapshot, $3::pg_snapshot, $4::xid8, $5, clock_timestamp()) RETURNING seq)
			DELETE FROM ` + p + ` WHERE outbox_table = $1 AND (SELECT seq FROM moved) % 1000 = 0 AND seq < (SELECT seq FROM moved) - 1000
				AND seq >= CASE WHEN (SELECT seq FROM moved) % 100000 = 0 THEN 0 ELSE $6::bigint - 3000 END`,
		slowSQL: `UPDATE ` + t + ` SET slow = true WHERE id = ANY($1)`,
		// The rows of the transactions that were in progress at the
		// position ($5, an array the planner can use as an index
		// condition), from ($2, $3) on.
		xipSQL: page(`o.tx = ANY($5::xid8[]) AND (o.tx, o.id) > ($2::xid8, $3::bigint)`),
		// The newer transactions' rows, from ($2, $3) on (never below the
		// position's xmax: fastPage sees to it), up to the range's xmax.
		// (None is one of $5, all older: said so that both queries take
		// the same arguments.)
		rangeSQL: page(`(o.tx, o.id) > ($2::xid8, $3::bigint) AND o.tx < pg_snapshot_xmax($1::pg_snapshot) AND o.tx <> ALL($5::xid8[])`),
		lockKeptSQL: columns("$4", "$2", "$3") + `
		WHERE o.id = ANY($1::bigint[]) AND o.dispatched_at IS NULL AND NOT o.slow
		ORDER BY o.tx, o.id` + lock,
	}
}

// position is the relay's place in an outbox table.
type position struct {
	snap   string
	cur    *string
	lastTx *string
	lastID *int64
	// seq is the row it was read from (0: none yet).
	seq int64
	// changed: the batch moved it, so it is written.
	changed bool
}

// fastRow is a row of the append-only lane's page.
type fastRow struct {
	claimedRow
	tx          string
	due, behind bool
}

// fastBatch relays one page of the append-only lane: the rows committed
// since the position, in (tx, id) order. It returns took false, and does
// nothing, when another relay holds the position (it works the slow lane
// meanwhile).
func (r *Relay) fastBatch(ctx context.Context) (res BatchResult, took bool, err error) {
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return res, false, fmt.Errorf("beginning relay transaction: %w", err)
	}
	defer func() {
		if err != nil || !took {
			rollback(ctx, tx)
		}
	}()
	var mine bool
	if err = tx.QueryRow(ctx, r.fast.lockSQL, r.quoted).Scan(&mine, nil); err != nil {
		return res, false, fmt.Errorf("locking the relay's position: %w", err)
	}
	if !mine {
		return res, false, nil
	}
	pos := position{snap: startSnapshot}
	err = tx.QueryRow(ctx, r.fast.readSQL, r.key).Scan(&pos.snap, &pos.cur, &pos.lastTx, &pos.lastID, &pos.seq)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return res, false, fmt.Errorf("reading the relay's position in %s: %w", PositionTable, err)
	}
	took = true
	// fresh: no range in progress; this batch starts one at a new snapshot.
	fresh := pos.cur == nil
	if fresh {
		var cur string
		if err = tx.QueryRow(ctx, r.fast.snapSQL).Scan(&cur); err != nil {
			return res, took, fmt.Errorf("taking a snapshot: %w", err)
		}
		zeroTx, zeroID := "0", int64(0)
		pos.cur, pos.lastTx, pos.lastID = &cur, &zeroTx, &zeroID
		if behind, err := serverBehind(pos.snap, cur); err != nil {
			return res, took, err
		} else if behind {
			return res, took, r.restart(ctx, tx, pos.snap, cur)
		}
	}
	size := r.cfg.BatchSize
	if n := r.pageSize.Load(); n > 0 {
		size = int(n)
	}
	page, err := r.fastPage(ctx, tx, pos, size)
	if err != nil {
		return res, took, err
	}
	r.pageSize.Store(int64(r.nextPageSize(page, size)))
	r.claims.Add(1)
	// Up to the first row too young for the lane (RelayConfig.MinAge):
	// the range is not done, and the position stays before it.
	rows, young := page, false
	if r.cfg.MinAge > 0 {
		edge := time.Now().Add(-r.cfg.MinAge)
		for i, c := range page {
			if c.createdAt.After(edge) {
				rows, young = page[:i], true
				break
			}
		}
	}
	res.Passed = len(rows)
	kept := rows
	if r.cfg.MinAge > 0 && len(rows) > 0 {
		if kept, err = r.lockKept(ctx, tx, pos, rows); err != nil {
			return res, took, err
		}
	}
	// A row held back, or delayed, holds its ordered aggregate's later rows
	// of this page back too.
	blocked := map[string]bool{}
	var held []int64
	var claimed []claimedRow
	for _, c := range kept {
		key, ordered := r.orderKey(c.claimedRow)
		switch {
		case ordered && blocked[key], c.behind, !c.due:
			held = append(held, c.id)
			if ordered {
				blocked[key] = true
			}
		default:
			claimed = append(claimed, c.claimedRow)
			if ordered {
				res.Ordered++
			}
		}
	}
	res.Claimed, res.Left = len(claimed), len(held)
	switch {
	case len(rows) > 0:
		last := rows[len(rows)-1]
		pos.lastTx, pos.lastID, pos.changed = &last.tx, &last.id, true
		if len(page) < size && !young {
			pos.snap, pos.cur, pos.lastTx, pos.lastID = *pos.cur, nil, nil, nil
		}
	case !young:
		// The range is done: its snapshot is the new position. Written
		// unless it is the position already (nothing committed since).
		pos.changed = !fresh || *pos.cur != pos.snap
		pos.snap, pos.cur, pos.lastTx, pos.lastID = *pos.cur, nil, nil, nil
	}
	record := func(b *pgx.Batch, unsent []int64) {
		held := append(held, unsent...)
		if len(held) > 0 {
			b.Queue(r.fast.slowSQL, held)
		}
		if pos.changed {
			b.Queue(r.fast.moveSQL, r.key, pos.snap, pos.cur, pos.lastTx, pos.lastID, pos.seq)
		}
	}
	if len(claimed) == 0 {
		b := &pgx.Batch{}
		record(b, nil)
		if b.Len() > 0 {
			if err = tx.SendBatch(ctx, b).Close(); err != nil {
				return res, took, fmt.Errorf("recording the relay's position: %w", err)
			}
		}
		return res, took, tx.Commit(ctx)
	}
	res, err = r.relayClaimed(ctx, tx, claimed, res, false, record)
	return res, took, err
}

// lockKept locks the page's rows kept (read without a lock, the relay
// having a MinAge) and reads them again, in (tx, id) order. A row
// dispatched or made slow meanwhile (by the CDC relay) is left out: the
// position still passes it, as it passes any row another writer took.
func (r *Relay) lockKept(ctx context.Context, tx pgx.Tx, pos position, page []fastRow) ([]fastRow, error) {
	ids := make([]int64, len(page))
	for i, c := range page {
		ids[i] = c.id
	}
	args := []any{ids}
	if len(r.ordered) > 0 {
		args = append(args, r.ordered, pos.snap, *pos.cur)
	}
	rows, err := tx.Query(ctx, r.fast.lockKeptSQL, args...)
	if err != nil {
		return nil, fmt.Errorf("locking the outbox rows old enough to relay: %w", err)
	}
	return pgx.CollectRows(rows, scanFastRow)
}

// serverBehind says whether the server's transaction ids are behind the
// position's: the database was restored into another cluster (pg_dump and
// pg_restore, a logical copy), which starts its ids anew, so that the rows
// written from now on would look older than the position and never be
// read.
func serverBehind(position, current string) (bool, error) {
	p, err := parseSnapshot(position)
	if err != nil {
		return false, err
	}
	c, err := parseSnapshot(current)
	if err != nil {
		return false, err
	}
	return p.xmax > c.xmax, nil
}

// restart gives the rows of the outbox the position no longer fits the
// state they would have without it, then starts the position anew at cur,
// in tx: the rows the position passed are marked dispatched (their
// creation time, as migrate down does), the others lose their tx and are
// relayed by the slow lane, in id order, like rows written before
// migration 00024. A row written since the restore has a small tx that the
// old position would take for passed: it was written after the position
// last moved, which tells it apart. One statement over the table, once
// after a restore.
func (r *Relay) restart(ctx context.Context, tx pgx.Tx, position, cur string) error {
	r.logger.Error("the relay's position is ahead of the server's transaction ids: the database was restored into another cluster; converting the outbox's rows to per-row state and starting the position anew",
		"position", position, "server", cur)
	if _, err := tx.Exec(ctx, `UPDATE `+r.quoted+` o SET
		dispatched_at = CASE WHEN `+passedCond("o", r.quoted, r.key)+`
			AND o.created_at <= (SELECT rp.moved_at FROM `+latestPosition(r.quoted, r.key)+` rp) THEN o.created_at END,
		tx = NULL
		WHERE o.dispatched_at IS NULL AND NOT o.slow AND o.tx IS NOT NULL`); err != nil {
		return fmt.Errorf("converting the outbox after a restore: %w", err)
	}
	if _, err := tx.Exec(ctx, r.fast.moveSQL, r.key, cur, nil, nil, nil, 0); err != nil {
		return fmt.Errorf("starting the relay's position anew: %w", err)
	}
	return tx.Commit(ctx)
}

// fastPage reads the next page of the range: rows of transactions that
// were in progress when the position was taken first, then newer ones.
func (r *Relay) fastPage(ctx context.Context, tx pgx.Tx, pos position, size int) ([]fastRow, error) {
	snap, err := parseSnapshot(pos.snap)
	if err != nil {
		return nil, err
	}
	lastTx, err := strconv.ParseUint(*pos.lastTx, 10, 64)
	if err != nil {
		return nil, fmt.Errorf("the relay's position: last_tx %q: %w", *pos.lastTx, err)
	}
	xip := make([]string, len(snap.xip))
	for i, x := range snap.xip {
		xip[i] = strconv.FormatUint(x, 10)
	}
	read := func(sql string, fromTx uint64, afterID int64, limit int) ([]fastRow, error) {
		// $1 the range's snapshot, $2 and $3 where to start, $4 the
		// limit, $5 the position's in-progress transactions; when
		// ordered, $6 the ordered topics and $7 the position.
		args := []any{*pos.cur, strconv.FormatUint(fromTx, 10), afterID, limit, xip}
		if len(r.ordered) > 0 {
			args = append(args, r.ordered, pos.snap)
		}
		rows, err := tx.Query(ctx, sql, args...)
		if err != nil {
			return nil, fmt.Errorf("reading outbox rows since the relay's position: %w", err)
		}
		return pgx.CollectRows(rows, scanFastRow)
	}
	// The transactions in progress at the position first (they are
	// older), then the newer ones.
	var page []fastRow
	if len(xip) > 0 && lastTx < snap.xmax {
		rows, err := read(r.fast.xipSQL, lastTx, *pos.lastID, size)
		if err != nil || len(rows) == size {
			return rows, err
		}
		page = rows
	}
	fromTx, afterID := lastTx, *pos.lastID
	if fromTx < snap.xmax {
		fromTx, afterID = snap.xmax, 0
	}
	more, err := read(r.fast.rangeSQL, fromTx, afterID, size-len(page))
	return append(page, more...), err
}

// nextPageSize is the size of the fast lane's page after page, read with
// limit size: BatchSize unless page came back full (the relay is behind),
// then CatchUpBatchSize, less when page's rows are large, so that a page
// holds about catchUpPageBytes (never fewer than BatchSize rows). See
// RelayConfig.CatchUpBatchSize for why.
func (r *Relay) nextPageSize(page []fastRow, size int) int {
	if len(page) < size { // size >= 1, so a full page has rows to divide by
		return r.cfg.BatchSize
	}
	var bytes int
	for _, c := range page {
		bytes += len(c.payload)
	}
	perRow := max(bytes/len(page), 1)
	return max(r.cfg.BatchSize, min(r.cfg.CatchUpBatchSize, catchUpPageBytes/perRow))
}

func scanFastRow(row pgx.CollectableRow) (fastRow, error) {
	var c fastRow
	err := row.Scan(&c.id, &c.uuid, &c.aggregateID, &c.topic, &c.payload, &c.headers, &c.attempts, &c.createdAt, &c.dueAt, &c.shadowMarked,
		&c.tx, &c.due, &c.behind)
	return c, err
}

// snapshot is a pg_snapshot's text, "xmin:xmax:xip,...".
type snapshot struct {
	xmin, xmax uint64
	xip        []uint64 // ascending
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
