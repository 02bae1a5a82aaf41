// Package pgweeks is the ring of weekly partitions Ferry's growing tables
// are kept in (the outbox, migration 00025; the consumers' ledger, 00026):
// a row's part is the week it was written in, one of Slots slots that are
// reused in turn, so that retention empties a whole week with TRUNCATE
// instead of deleting row by row. A deleted row is a dead tuple that a long
// transaction elsewhere (a report, pg_dump, a standby's feedback) keeps
// from being vacuumed; a truncated partition leaves none.
//
// The table a ring replaced is its partition Legacy, pruned row by row by
// its owner until retention has passed since the upgrade, then emptied the
// same way.
//
// The package knows the ring, not the tables: their owners (pgoutbox,
// pgledger) say what a row past retention is and what must happen to it
// before its partition is emptied.
package pgweeks

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

// The ring; the SQL function ferry_outbox_part (migration 00025) computes
// the same slot for both tables.
const (
	// Slots is how many weekly partitions the ring holds.
	Slots = 16
	// Period is how long one slot takes new rows.
	Period = 7 * 24 * time.Hour
	// shift aligns weeks on Mondays 00:00 UTC (the epoch was a Thursday).
	shift = 3 * 24 * time.Hour
	// Legacy is the partition that was the table before the ring.
	Legacy = -1
	// MaxRetention is the longest retention a ring serves: a slot takes
	// rows again Slots weeks after it last did, and it must be cleared in
	// between (a week kept in hand).
	MaxRetention = (Slots - 2) * Period
)

// Week is the number of the week t is in, counted from the epoch's first
// Monday (as the migrations' SQL counts it).
func Week(t time.Time) int64 {
	s := t.Unix() + int64(shift/time.Second)
	p := int64(Period / time.Second)
	w := s / p
	if s%p < 0 {
		w--
	}
	return w
}

// Of is the slot a row written at t goes to.
func Of(t time.Time) int {
	return int(((Week(t) % Slots) + Slots) % Slots)
}

// windowStart is when week w began.
func windowStart(w int64) time.Time {
	return time.Unix(w*int64(Period/time.Second)-int64(shift/time.Second), 0).UTC()
}

// Partition is one partition of a ring.
type Partition struct {
	// Name is the partition's table name.
	Name string `json:"name"`
	// Part is its slot (Legacy for the table of before the ring).
	Part int `json:"part"`
	// Current is true of the slot taking new rows.
	Current bool `json:"current"`
	// From and Until bound the slot's last week (zero for the legacy
	// partition: Until is its newest row's time, zero if empty).
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

// OverdueGrace is how long past the first prune that should have cleared
// a partition it may still hold rows before Overdue reports it: the prune
// in progress, one waiting out a lock for a while.
const OverdueGrace = time.Hour

// Overdue returns the partitions of parts (listed at now) that a prune with
// this retention should have cleared a prune interval and OverdueGrace
// ago, and since when the oldest of them has been past retention: a prune
// that does not run, or that a lock keeps from clearing them (pg_dump, a
// long transaction). The status's attention list and the metrics' gauges
// judge by it. Zero retention judges nothing.
func Overdue(parts []Partition, now time.Time, retention, pruneInterval time.Duration) (late []Partition, since time.Time) {
	if retention <= 0 {
		return nil, since
	}
	for _, p := range parts {
		if !p.PastRetention(now.Add(-retention - pruneInterval - OverdueGrace)) {
			continue
		}
		late = append(late, p)
		if at := p.Until.Add(retention); since.IsZero() || at.Before(since) {
			since = at
		}
	}
	return late, since
}

// Reader is what List reads with: a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// List lists the partitions of the quoted table, or nil when it is not
// partitioned. newest is a query for the legacy partition's newest row
// time (NULL when empty), given that partition's quoted name: its owner
// knows which column and index say it. now is the database's clock.
func List(ctx context.Context, q Reader, quoted string, newest func(partition string) string) (parts []Partition, now time.Time, err error) {
	// One statement for the catalog and one for all the partitions'
	// emptiness: a status page reads this every few seconds.
	rows, err := q.Query(ctx, `
		SELECT c.relname, substring(pg_get_expr(c.relpartbound, c.oid) from '\(''?(-?[0-9]+)''?\)')::int,
		       c.reltuples::bigint, now()
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = to_regclass($1) ORDER BY 2`, quoted)
	if err != nil {
		return nil, now, fmt.Errorf("listing the partitions of %s: %w", quoted, err)
	}
	for rows.Next() {
		var p Partition
		if err := rows.Scan(&p.Name, &p.Part, &p.Rows, &now); err != nil {
			rows.Close()
			return nil, now, fmt.Errorf("listing the partitions of %s: %w", quoted, err)
		}
		parts = append(parts, p)
	}
	if err := rows.Err(); err != nil {
		return nil, now, fmt.Errorf("listing the partitions of %s: %w", quoted, err)
	}
	if len(parts) == 0 {
		return nil, now, nil
	}
	var probes []string
	legacyAt := -1
	for i, p := range parts {
		qp := Name(quoted, p.Name)
		if p.Part == Legacy {
			legacyAt = i
			probes = append(probes, `(`+newest(qp)+`)::timestamptz`)
			continue
		}
		probes = append(probes, `CASE WHEN EXISTS (SELECT 1 FROM `+qp+`) THEN now() END`)
	}
	vals := make([]*time.Time, len(probes))
	dest := make([]any, len(probes))
	for i := range vals {
		dest[i] = &vals[i]
	}
	if err := q.QueryRow(ctx, `SELECT `+strings.Join(probes, ", ")).Scan(dest...); err != nil {
		return nil, now, fmt.Errorf("reading the partitions of %s: %w", quoted, err)
	}
	wNow := Week(now)
	for i := range parts {
		p := &parts[i]
		p.Empty = vals[i] == nil
		if i == legacyAt {
			if vals[i] != nil {
				p.Until = *vals[i]
			}
			continue
		}
		back := ((wNow-int64(p.Part))%Slots + Slots) % Slots
		p.Current = back == 0
		p.From = windowStart(wNow - back)
		if !p.Current {
			p.Until = windowStart(wNow - back + 1)
		}
	}
	return parts, now, nil
}

// Name is the quoted name of partition name, beside the quoted table.
func Name(quotedTable, name string) string {
	t := pgx.Identifier{name}.Sanitize()
	if i := strings.LastIndex(quotedTable, `"."`); i >= 0 {
		return quotedTable[:i+1] + "." + t
	}
	return t
}

// LegacyRelation is the quoted relation a row-by-row prune reads: the
// legacy partition of a ring (the others are cleared whole), "" when the
// ring has none, or the table itself when it is not partitioned.
func LegacyRelation(ctx context.Context, q Reader, quoted string) (string, error) {
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
	return Name(quoted, *legacy), nil
}

// Cleared says what a retention's pass over a ring did (with a dry run:
// would do).
type Cleared struct {
	// Partitions are those emptied.
	Partitions []string `json:"partitions,omitempty"`
	// Rows is how many rows past retention they held.
	Rows int64 `json:"rows"`
	// Moved is how many rows still needed went to the current partition
	// first (the outbox's pending rows; the ledger has none).
	Moved int64 `json:"moved_pending"`
	// Waiting are the partitions past retention a lock kept from being
	// cleared, each with why; the next prune tries again.
	Waiting []string `json:"waiting,omitempty"`
}

// lockTries and lockTimeout bound how long Truncate waits for a
// partition: the table's writers and readers queue behind its lock
// request, so it gives up early and the next prune tries again.
const (
	lockTries   = 5
	lockTimeout = "200ms"
)

// ErrLocked is Truncate's answer when a lock on the partition (pg_dump,
// a long transaction that read the table) outlasted its tries.
var ErrLocked = errors.New("a transaction holds a lock on it (pg_dump, a long transaction that read the table); tried again at the next prune")

// Truncate empties the quoted partition in one transaction that holds it
// exclusively, after before (nil for none) has run in that transaction: no
// row can arrive or change between before and the TRUNCATE. It returns
// before's count, and an error wrapping ErrLocked when the lock could not
// be had in a few short tries.
func Truncate(ctx context.Context, pool *pgxpool.Pool, partition string, before func(tx pgx.Tx) (int64, error)) (int64, error) {
	for try := 0; ; try++ {
		n, err := func() (int64, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return 0, err
			}
			defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit a no-op; otherwise the error is the one returned
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+lockTimeout+`'`); err != nil {
				return 0, err
			}
			if _, err := tx.Exec(ctx, `LOCK TABLE `+partition+` IN ACCESS EXCLUSIVE MODE`); err != nil {
				return 0, err
			}
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = 0`); err != nil {
				return 0, err
			}
			var n int64
			if before != nil {
				if n, err = before(tx); err != nil {
					return 0, err
				}
			}
			if _, err := tx.Exec(ctx, `TRUNCATE `+partition); err != nil {
				return 0, err
			}
			return n, tx.Commit(ctx)
		}()
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
			return n, err
		}
		if try+1 == lockTries {
			return 0, fmt.Errorf("%w: %w", ErrLocked, err)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(time.Duration(try+1) * 200 * time.Millisecond):
		}
	}
}
