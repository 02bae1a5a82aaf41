package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgweeks"
)

// Retention by whole partitions (migration 00025).
//
// The outbox is partitioned by part, a ring of pgweeks.Slots weekly
// slots: a row's part is the week it was written in. A slot whose last
// week ended before the retention's cutoff holds only rows past retention;
// ClearPartitions moves its pending rows (a far delay, a failing row) to
// the current slot, keeping their ids and so their order, and empties it
// with TRUNCATE: no row-by-row DELETE, so no dead tuple for a long
// transaction to keep. The table the outbox was before the migration is
// the partition pgweeks.Legacy; its rows are pruned row by row as before until
// retention has passed since the upgrade, then it is emptied the same way.

// Partitions lists the outbox table's partitions (see pgweeks), or nil
// when it is not partitioned (an outbox table Ferry's migrations did not
// create). now is the database's clock.
func (t Table) Partitions(ctx context.Context, q Reader) (parts []pgweeks.Partition, now time.Time, err error) {
	// The legacy partition, written before the upgrade and pruned row by
	// row since: its newest row (the highest id) says when it was last
	// written.
	return pgweeks.List(ctx, q, t.Quoted(), func(qp string) string {
		return `SELECT created_at FROM ` + qp + ` ORDER BY id DESC LIMIT 1`
	})
}

// Reader is what Partitions reads with: a pool, a connection or a
// transaction.
type Reader = pgweeks.Reader

// Cleared says what ClearPartitions did.
type Cleared = pgweeks.Cleared

// ClearPartitions empties, with TRUNCATE, each partition of the outbox
// table whose rows are all older than cutoff, after moving its pending
// rows to the current partition (ids, and so the order per aggregate,
// unchanged); with archive it first copies the partition's rows to the
// archive table. A partition a lock keeps (pg_dump, a long transaction that
// read the outbox) is reported waiting, not waited for. A table that is not
// partitioned is left alone.
func (t Table) ClearPartitions(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time, archive, dryRun bool) (Cleared, error) {
	var res Cleared
	parts, _, err := t.Partitions(ctx, pool)
	if err != nil {
		return res, err
	}
	for _, p := range parts {
		if !p.PastRetention(cutoff) {
			continue
		}
		qp := pgweeks.Name(t.Quoted(), p.Name)
		var rows, pending int64
		// Counted before the lock: a scan of rows nobody writes any more,
		// not to be done while the relays wait.
		if err := pool.QueryRow(ctx, `SELECT count(*), (SELECT count(*) FROM `+t.pendingRowsOf("o.id", qp)+` pr) FROM `+qp).Scan(&rows, &pending); err != nil {
			return res, fmt.Errorf("counting partition %s: %w", p.Name, err)
		}
		if dryRun {
			res.Partitions = append(res.Partitions, p.Name)
			res.Rows += rows - pending
			res.Moved += pending
			continue
		}
		moved, err := pgweeks.Truncate(ctx, pool, qp, func(tx pgx.Tx) (int64, error) {
			return t.movePending(ctx, tx, qp, p.Part, archive)
		})
		if errors.Is(err, pgweeks.ErrLocked) {
			res.Waiting = append(res.Waiting, p.Name+": "+pgweeks.ErrLocked.Error())
			continue
		}
		if err != nil {
			return res, fmt.Errorf("clearing partition %s: %w", p.Name, err)
		}
		res.Partitions = append(res.Partitions, p.Name)
		res.Rows += rows - moved
		res.Moved += moved
	}
	return res, nil
}

// movePending moves partition qp's pending rows to the current partition
// and, with archive, copies its rows to the archive table, in tx (which
// holds qp exclusively, to truncate it next). It says how many rows moved.
func (t Table) movePending(ctx context.Context, tx pgx.Tx, qp string, part int, archive bool) (int64, error) {
	// SET part = DEFAULT: the current week's slot, by the same expression
	// as an insert's.
	tag, err := tx.Exec(ctx, `UPDATE `+t.Quoted()+` t SET part = DEFAULT
		FROM `+t.pendingRowsOf("o.id", qp)+` pr WHERE t.id = pr.id AND t.part = $1`, part)
	if err != nil {
		return 0, fmt.Errorf("moving its pending rows: %w", err)
	}
	if archive {
		if _, err := tx.Exec(ctx, `INSERT INTO `+t.Archive()+` SELECT * FROM `+qp+` ON CONFLICT (id) DO NOTHING`); err != nil {
			return 0, fmt.Errorf("archiving its rows: %w", err)
		}
	}
	return tag.RowsAffected(), nil
}
