package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

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

// pageRow is a row of the append-only lane's page.
type pageRow struct {
	claimedRow
	tx          string
	due, behind bool
}

// appendBatch relays one page of the append-only lane: the rows committed
// since the position, in (tx, id) order. It returns took false, and does
// nothing, when another relay holds the position (it works the slow lane
// meanwhile). The steps, in order: take the position (takePosition), start
// a range at a new snapshot unless one is in progress (startRange), read a
// page of it (readPage), sort the page into rows to send and rows to hold
// (sortPage), move the position past the page (advance), then publish and
// record, the position's move with the outcome (relayClaimed).
//
// wait makes it wait for a position another relay's batch holds, up to
// that batch's bound, instead of giving up at once (see loop).
func (r *Relay) appendBatch(ctx context.Context, wait bool) (res BatchResult, took bool, err error) {
	tx, err := r.pool.BeginTx(ctx, r.txOptions)
	if err != nil {
		return res, false, fmt.Errorf("beginning relay transaction: %w", err)
	}
	defer func() {
		if err != nil || !took {
			rollback(ctx, tx)
		}
	}()
	pos, took, err := r.takePosition(ctx, tx, wait)
	if err != nil || !took {
		return res, took, err
	}
	// fresh: no range in progress; this batch starts one at a new snapshot.
	fresh := pos.cur == nil
	if fresh {
		if restarted, err := r.startRange(ctx, tx, &pos); err != nil || restarted {
			return res, took, err
		}
	}
	pg, err := r.readPage(ctx, tx, pos)
	if err != nil {
		return res, took, err
	}
	res.Passed = len(pg.rows)
	claimed, held, ordered := r.sortPage(pg.kept)
	res.Claimed, res.Left, res.Ordered = len(claimed), len(held), ordered
	pos.advance(pg, fresh)
	record := func(b *pgx.Batch, unsent []int64) {
		if held := append(held, unsent...); len(held) > 0 {
			b.Queue(r.appendOnly.slowSQL, held)
		}
		if pos.changed {
			b.Queue(r.appendOnly.moveSQL, pgx.NamedArgs{
				"key": r.t.Key(), "snap": pos.snap, "cur": pos.cur, "last_tx": pos.lastTx, "last_id": pos.lastID, "seq": pos.seq,
			})
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

// takePosition takes the position for this batch: false when another
// relay's batch holds it, at once, or, with wait, once that batch's bound
// ran out.
func (r *Relay) takePosition(ctx context.Context, tx pgx.Tx, wait bool) (position, bool, error) {
	mine := true
	if wait {
		// The holder's batch ends within its confirm timeout, or the
		// server ends its session 2 s later (batchBeginSQL).
		_, err := tx.Exec(ctx, positionWaitSQL(r.cfg.ConfirmTimeout+batchIdleSlack), pgx.QueryExecModeSimpleProtocol, r.t.Quoted())
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available: past the bound
			return position{}, false, nil
		}
		if err != nil {
			return position{}, false, fmt.Errorf("waiting for the relay's position: %w", err)
		}
	} else if err := tx.QueryRow(ctx, r.appendOnly.lockSQL, r.t.Quoted()).Scan(&mine, nil); err != nil {
		return position{}, false, fmt.Errorf("locking the relay's position: %w", err)
	}
	if !mine {
		return position{}, false, nil
	}
	pos := position{snap: startSnapshot}
	err := tx.QueryRow(ctx, r.appendOnly.readSQL, r.t.Key()).Scan(&pos.snap, &pos.cur, &pos.lastTx, &pos.lastID, &pos.seq)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return position{}, false, fmt.Errorf("reading the relay's position in %s: %w", PositionTable, err)
	}
	return pos, true, nil
}

// startRange starts a range at a new snapshot. restarted: the server's
// transaction ids are behind the position (a restore into another
// cluster), so the batch converted the outbox and committed instead.
func (r *Relay) startRange(ctx context.Context, tx pgx.Tx, pos *position) (restarted bool, err error) {
	var cur string
	if err = tx.QueryRow(ctx, r.appendOnly.snapSQL).Scan(&cur); err != nil {
		return false, fmt.Errorf("taking a snapshot: %w", err)
	}
	zeroTx, zeroID := "0", int64(0)
	pos.cur, pos.lastTx, pos.lastID = &cur, &zeroTx, &zeroID
	behind, err := serverBehind(pos.snap, cur)
	if err != nil || !behind {
		return false, err
	}
	return true, r.restart(ctx, tx, pos.snap, cur)
}

// page is what readPage read of the range.
type page struct {
	// all is the page as read; size the rows it asked for.
	all  []pageRow
	size int
	// rows are those old enough for the lane (RelayConfig.MinAge), up to
	// the first too young; young says one was. kept are rows less those
	// another writer took meanwhile (the CDC relay).
	rows, kept []pageRow
	young      bool
}

// readPage reads the range's next page, at the size the last page asked
// for (catch-up pages), and the rows of it the lane may take.
func (r *Relay) readPage(ctx context.Context, tx pgx.Tx, pos position) (page, error) {
	pg := page{size: r.cfg.BatchSize}
	if n := r.pageSize.Load(); n > 0 {
		pg.size = int(n)
	}
	var err error
	if pg.all, err = r.appendPage(ctx, tx, pos, pg.size); err != nil {
		return pg, err
	}
	r.pageSize.Store(int64(r.nextPageSize(pg.all, pg.size)))
	r.claims.Add(1)
	// Up to the first row too young for the lane: the range is not done,
	// and the position stays before it.
	pg.rows = pg.all
	if r.cfg.MinAge > 0 {
		edge := time.Now().Add(-r.cfg.MinAge)
		for i, c := range pg.all {
			if c.createdAt.After(edge) {
				pg.rows, pg.young = pg.all[:i], true
				break
			}
		}
	}
	pg.kept = pg.rows
	if r.cfg.MinAge > 0 && len(pg.rows) > 0 {
		if pg.kept, err = r.lockKept(ctx, tx, pos, pg.rows); err != nil {
			return pg, err
		}
	}
	return pg, nil
}

// sortPage sorts the page's rows into those to publish and those to hold
// in the slow lane: held behind an earlier row of their ordered aggregate,
// or delayed. A row held holds its ordered aggregate's later rows of this
// page back too. ordered counts the rows to publish of ordered topics.
func (r *Relay) sortPage(kept []pageRow) (claimed []claimedRow, held []int64, ordered int) {
	blocked := map[string]bool{}
	for _, c := range kept {
		key, isOrdered := r.orderKey(c.claimedRow)
		switch {
		case isOrdered && blocked[key], c.behind, !c.due:
			held = append(held, c.id)
			if isOrdered {
				blocked[key] = true
			}
		default:
			claimed = append(claimed, c.claimedRow)
			if isOrdered {
				ordered++
			}
		}
	}
	return claimed, held, ordered
}

// advance moves the position past the page: to its last row, or, when
// the range is done (a page not full, no row too young), to the range's
// snapshot. fresh: the batch started the range.
func (pos *position) advance(pg page, fresh bool) {
	switch {
	case len(pg.rows) > 0:
		last := pg.rows[len(pg.rows)-1]
		pos.lastTx, pos.lastID, pos.changed = &last.tx, &last.id, true
		if len(pg.all) < pg.size && !pg.young {
			pos.snap, pos.cur, pos.lastTx, pos.lastID = *pos.cur, nil, nil, nil
		}
	case !pg.young:
		// The range is done: its snapshot is the new position. Written
		// unless it is the position already (nothing committed since).
		pos.changed = !fresh || *pos.cur != pos.snap
		pos.snap, pos.cur, pos.lastTx, pos.lastID = *pos.cur, nil, nil, nil
	}
}

// lockKept locks the page's rows kept (read without a lock, the relay
// having a MinAge) and reads them again, in (tx, id) order. A row
// dispatched or made slow meanwhile (by the CDC relay) is left out: the
// position still passes it, as it passes any row another writer took.
func (r *Relay) lockKept(ctx context.Context, tx pgx.Tx, pos position, page []pageRow) ([]pageRow, error) {
	ids := make([]int64, len(page))
	for i, c := range page {
		ids[i] = c.id
	}
	rows, err := tx.Query(ctx, r.appendOnly.lockKeptSQL, pgx.NamedArgs{
		"ids": ids, "topics": r.ordered, "position": pos.snap, "range": *pos.cur,
	})
	if err != nil {
		return nil, fmt.Errorf("locking the outbox rows old enough to relay: %w", err)
	}
	return pgx.CollectRows(rows, scanPageRow)
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
	if _, err := tx.Exec(ctx, `UPDATE `+r.t.Quoted()+` o SET
		dispatched_at = CASE WHEN `+r.t.passedCond("o")+`
			AND o.created_at <= (SELECT rp.moved_at FROM `+r.t.latestPosition()+` rp) THEN o.created_at END,
		tx = NULL
		WHERE o.dispatched_at IS NULL AND NOT o.slow AND o.tx IS NOT NULL`); err != nil {
		return fmt.Errorf("converting the outbox after a restore: %w", err)
	}
	if _, err := tx.Exec(ctx, r.appendOnly.moveSQL, pgx.NamedArgs{"key": r.t.Key(), "snap": cur, "seq": 0}); err != nil {
		return fmt.Errorf("starting the relay's position anew: %w", err)
	}
	return tx.Commit(ctx)
}

// appendPage reads the next page of the range: rows of transactions that
// were in progress when the position was taken first, then newer ones.
func (r *Relay) appendPage(ctx context.Context, tx pgx.Tx, pos position, size int) ([]pageRow, error) {
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
	read := func(sql string, fromTx uint64, afterID int64, limit int) ([]pageRow, error) {
		rows, err := tx.Query(ctx, sql, pgx.NamedArgs{
			"range": *pos.cur, "after_tx": strconv.FormatUint(fromTx, 10), "after_id": afterID, "limit": limit,
			"xip": xip, "topics": r.ordered, "position": pos.snap,
		})
		if err != nil {
			return nil, fmt.Errorf("reading outbox rows since the relay's position: %w", err)
		}
		return pgx.CollectRows(rows, scanPageRow)
	}
	// The transactions in progress at the position first (they are
	// older), then the newer ones.
	var page []pageRow
	if len(xip) > 0 && lastTx < snap.xmax {
		rows, err := read(r.appendOnly.xipSQL, lastTx, *pos.lastID, size)
		if err != nil || len(rows) == size {
			return rows, err
		}
		page = rows
	}
	fromTx, afterID := lastTx, *pos.lastID
	if fromTx < snap.xmax {
		fromTx, afterID = snap.xmax, 0
	}
	more, err := read(r.appendOnly.rangeSQL, fromTx, afterID, size-len(page))
	return append(page, more...), err
}

// nextPageSize is the size of the append-only lane's page after page, read with
// limit size: BatchSize unless page came back full (the relay is behind),
// then CatchUpBatchSize, less when page's rows are large, so that a page
// holds about catchUpPageBytes (never fewer than BatchSize rows). See
// RelayConfig.CatchUpBatchSize for why.
func (r *Relay) nextPageSize(page []pageRow, size int) int {
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

func scanPageRow(row pgx.CollectableRow) (pageRow, error) {
	var c pageRow
	err := row.Scan(&c.id, &c.uuid, &c.aggregateID, &c.topic, &c.payload, &c.headers, &c.attempts, &c.createdAt, &c.dueAt, &c.shadowMarked,
		&c.tx, &c.due, &c.behind)
	return c, err
}
