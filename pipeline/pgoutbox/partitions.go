package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Retention by whole partitions (migration 00025).
//
// The outbox is partitioned by part, a ring of PartitionSlots weekly
// slots: a row's part is the week it was written in. A slot whose last
// week ended before the retention's cutoff holds only rows past retention;
// ClearPartitions moves its pending rows (a far delay, a failing row) to
// the current slot, keeping their ids and so their order, and empties it
// with TRUNCATE: no row-by-row DELETE, so no dead tuple for a long
// transaction to keep. The table the outbox was before the migration is
// the partition LegacyPart; its rows are pruned row by row as before until
// retention has passed since the upgrade, then it is emptied the same way.

// Partitioning of the outbox; ferry_outbox_part (migration 00025) computes
// the same.
const (
	// PartitionSlots is how many weekly partitions the ring holds.
	PartitionSlots = 16
	// PartitionPeriod is how long one slot takes new rows.
	PartitionPeriod = 7 * 24 * time.Hour
	// partitionShift aligns weeks on Mondays 00:00 UTC (the epoch was a
	// Thursday).
	partitionShift = 3 * 24 * time.Hour
	// LegacyPart is the partition that was the outbox table before
	// migration 00025.
	LegacyPart = -1
	// MaxPartitionedRetention is the longest outbox retention partitions
	// serve: a slot takes rows again PartitionSlots weeks after it last
	// did, and it must be cleared in between (a week kept in hand).
	MaxPartitionedRetention = (PartitionSlots - 2) * PartitionPeriod
)

// partitionWindow is the number of the week t is in.
func partitionWindow(t time.Time) int64 {
	s := t.Unix() + int64(partitionShift/time.Second)
	p := int64(PartitionPeriod / time.Second)
	w := s / p
	if s%p < 0 {
		w--
	}
	return w
}

// PartitionOf is the slot a row written at t goes to.
func PartitionOf(t time.Time) int {
	return int(((partitionWindow(t) % PartitionSlots) + PartitionSlots) % PartitionSlots)
}

// windowStart is when week w began.
func windowStart(w int64) time.Time {
	return time.Unix(w*int64(PartitionPeriod/time.Second)-int64(partitionShift/time.Second), 0).UTC()
}

// Partition is one partition of a partitioned outbox table.
type Partition struct {
	// Name is the partition's table name.
	Name string `json:"name"`
	// Part is its slot (LegacyPart for the table of before the upgrade).
	Part int `json:"part"`
	// Current is true of the slot taking new rows.
	Current bool `json:"current"`
	// From and Until bound the slot's last week (zero for the legacy
	// partition: Until is its newest row's creation time, zero if empty).
	From  time.Time `json:"from,omitzero"`
	Until time.Time `json:"until,omitzero"`
	// Empty is true when it holds no row.
	Empty bool `json:"empty"`
	// Rows is PostgreSQL's estimate of its rows (-1 before it was ever
	// analyzed).
	Rows int64 `json:"rows_estimate"`
}

// PastRetention is true when everything in p is older than cutoff, so a
// prune with that cutoff clears it.
func (p Partition) PastRetention(cutoff time.Time) bool {
	return !p.Current && !p.Empty && !p.Until.IsZero() && !p.Until.After(cutoff)
}

// Partitions lists the outbox table's partitions, or nil when it is not
// partitioned (an outbox table Ferry's migrations did not create). now is
// the database's clock.
func Partitions(ctx context.Context, q Reader, table string) (parts []Partition, now time.Time, err error) {
	quoted, err := QuoteTable(table)
	if err != nil {
		return nil, now, err
	}
	rows, err := q.Query(ctx, `
		SELECT c.relname, substring(pg_get_expr(c.relpartbound, c.oid) from '\(''?(-?[0-9]+)''?\)')::int,
		       c.reltuples::bigint, now()
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = to_regclass($1) ORDER BY 2`, quoted)
	if err != nil {
		return nil, now, fmt.Errorf("listing the outbox's partitions: %w", err)
	}
	for rows.Next() {
		var p Partition
		if err := rows.Scan(&p.Name, &p.Part, &p.Rows, &now); err != nil {
			rows.Close()
			return nil, now, fmt.Errorf("listing the outbox's partitions: %w", err)
		}
		parts = append(parts, p)
	}
	if err := rows.Err(); err != nil {
		return nil, now, fmt.Errorf("listing the outbox's partitions: %w", err)
	}
	wNow := partitionWindow(now)
	for i := range parts {
		p := &parts[i]
		qp := partitionName(quoted, p.Name)
		if p.Part == LegacyPart {
			// Written before the upgrade, pruned row by row since: its
			// newest row (the highest id) says when it was last written.
			var until *time.Time
			if err := q.QueryRow(ctx, `SELECT (SELECT created_at FROM `+qp+` ORDER BY id DESC LIMIT 1)`).Scan(&until); err != nil {
				return nil, now, fmt.Errorf("reading partition %s: %w", p.Name, err)
			}
			p.Empty = until == nil
			if until != nil {
				p.Until = *until
			}
			continue
		}
		if err := q.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM `+qp+`)`).Scan(&p.Empty); err != nil {
			return nil, now, fmt.Errorf("reading partition %s: %w", p.Name, err)
		}
		back := ((wNow-int64(p.Part))%PartitionSlots + PartitionSlots) % PartitionSlots
		p.Current = back == 0
		p.From = windowStart(wNow - back)
		if !p.Current {
			p.Until = windowStart(wNow - back + 1)
		}
	}
	return parts, now, nil
}

// partitionName is partition name beside the quoted outbox table.
func partitionName(quotedOutbox, name string) string {
	t := pgx.Identifier{name}.Sanitize()
	if i := strings.LastIndex(quotedOutbox, `"."`); i >= 0 {
		return quotedOutbox[:i+1] + "." + t
	}
	return t
}

// Reader is what Partitions reads with: a pool, a connection or a
// transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Cleared says what ClearPartitions did (with DryRun: would do).
type Cleared struct {
	// Partitions are those emptied.
	Partitions []string `json:"partitions,omitempty"`
	// Rows is how many dispatched rows they held.
	Rows int64 `json:"rows"`
	// Moved is how many pending rows went to the current partition first.
	Moved int64 `json:"moved_pending"`
	// Waiting are the partitions past retention a lock kept from being
	// cleared, each with why; the next prune tries again.
	Waiting []string `json:"waiting,omitempty"`
}

// clearLockTries and clearLockTimeout bound how long a clear waits for a
// partition: the relays' statements queue behind its lock request, so it
// gives up early and tries again at the next prune.
const (
	clearLockTries   = 5
	clearLockTimeout = "200ms"
)

// ClearPartitions empties, with TRUNCATE, each partition of the outbox
// table whose rows are all older than cutoff, after moving its pending
// rows to the current partition (ids, and so the order per aggregate,
// unchanged); with archive it first copies the partition's rows to the
// archive table. A partition a lock keeps (pg_dump, a long transaction that
// read the outbox) is reported waiting, not waited for. A table that is not
// partitioned is left alone.
func ClearPartitions(ctx context.Context, pool *pgxpool.Pool, table string, cutoff time.Time, archive, dryRun bool) (Cleared, error) {
	var res Cleared
	quoted, err := QuoteTable(table)
	if err != nil {
		return res, err
	}
	parts, _, err := Partitions(ctx, pool, table)
	if err != nil {
		return res, err
	}
	for _, p := range parts {
		if !p.PastRetention(cutoff) {
			continue
		}
		qp := partitionName(quoted, p.Name)
		var rows, pending int64
		// Counted before the lock: a scan of rows nobody writes any more,
		// not to be done while the relays wait.
		if err := pool.QueryRow(ctx, `SELECT count(*), (SELECT count(*) FROM `+PendingRows("o.id", qp, table)+` pr) FROM `+qp).Scan(&rows, &pending); err != nil {
			return res, fmt.Errorf("counting partition %s: %w", p.Name, err)
		}
		if dryRun {
			res.Partitions = append(res.Partitions, p.Name)
			res.Rows += rows - pending
			res.Moved += pending
			continue
		}
		moved, err := clearPartition(ctx, pool, quoted, qp, table, p.Part, archive)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			res.Waiting = append(res.Waiting, p.Name+": a transaction holds a lock on it (pg_dump, a long transaction that read the outbox); tried again at the next prune")
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

// clearPartition moves partition qp's pending rows out and truncates it,
// in one transaction holding it exclusively: no row can arrive or change
// between the move and the TRUNCATE. It says how many rows moved.
func clearPartition(ctx context.Context, pool *pgxpool.Pool, quoted, qp, table string, part int, archive bool) (int64, error) {
	var lastErr error
	for try := 0; try < clearLockTries; try++ {
		moved, err := func() (int64, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return 0, err
			}
			defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit a no-op; otherwise the error is the one returned
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+clearLockTimeout+`'`); err != nil {
				return 0, err
			}
			if _, err := tx.Exec(ctx, `LOCK TABLE `+qp+` IN ACCESS EXCLUSIVE MODE`); err != nil {
				return 0, err
			}
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = 0`); err != nil {
				return 0, err
			}
			// SET part = DEFAULT: the current week's slot, by the same
			// expression as an insert's.
			tag, err := tx.Exec(ctx, `UPDATE `+quoted+` t SET part = DEFAULT
				FROM `+PendingRows("o.id", qp, table)+` pr WHERE t.id = pr.id AND t.part = $1`, part)
			if err != nil {
				return 0, fmt.Errorf("moving its pending rows: %w", err)
			}
			if archive {
				a, err := QuoteTable(tableKey(table) + "_archive")
				if err != nil {
					return 0, err
				}
				if _, err := tx.Exec(ctx, `INSERT INTO `+a+` SELECT * FROM `+qp+` ON CONFLICT (id) DO NOTHING`); err != nil {
					return 0, fmt.Errorf("archiving its rows: %w", err)
				}
			}
			if _, err := tx.Exec(ctx, `TRUNCATE `+qp); err != nil {
				return 0, err
			}
			return tag.RowsAffected(), tx.Commit(ctx)
		}()
		if err == nil {
			return moved, nil
		}
		lastErr = err
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
			return 0, err
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(time.Duration(try+1) * 200 * time.Millisecond):
		}
	}
	return 0, lastErr
}

// legacyRows is the quoted relation a row-by-row prune reads: the legacy
// partition of a partitioned outbox (the other partitions are cleared
// whole), or the table itself when it is not partitioned.
func legacyRows(ctx context.Context, q Reader, quoted string) (string, error) {
	var legacy *string
	err := q.QueryRow(ctx, `
		SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = to_regclass($1) AND pg_get_expr(c.relpartbound, c.oid) LIKE '%(''-1'')%'`, quoted).Scan(&legacy)
	if errors.Is(err, pgx.ErrNoRows) {
		var parted bool
		if err := q.QueryRow(ctx, `SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)`, quoted).Scan(&parted); err != nil {
			return "", err
		}
		if parted {
			return "", nil
		}
		return quoted, nil
	}
	if err != nil {
		return "", err
	}
	return partitionName(quoted, *legacy), nil
}
