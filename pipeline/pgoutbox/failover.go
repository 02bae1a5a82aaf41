package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultFailoverReplay is RelayConfig.FailoverReplay's default.
const DefaultFailoverReplay = 5 * time.Minute

// failoverCheckInterval is how often a running relay asks for the
// server's timeline: one cheap query, so that a promotion is noticed
// within seconds of the relay reconnecting to the new primary.
const failoverCheckInterval = 5 * time.Second

// TimelineTable is the table (migration 00022) where relays remember the
// timeline of the server they last relayed on, one row per outbox table.
const TimelineTable = "ferry_relay_timelines"

// Why a failover replay exists. With asynchronous replication a promoted
// standby lacks the last commits the old primary made. Among them can be a
// consumer's ledger transaction (its effect and its processed_messages row)
// whose message the broker no longer holds: the consumer acked it after the
// commit the standby never received, while the relay's dispatch of that
// event, committed earlier, did reach the standby. On the new primary the
// event is dispatched and its effect is gone, and nothing would send it
// again. So when a relay finds the server on a newer timeline than the one
// recorded, it makes pending again the events dispatched in the window
// before the last dispatch the new primary knows of; the consumers' ledger
// drops the ones whose effect survived, and the others run again under
// their message id (the provider's idempotency key). A plain restart keeps
// the timeline and replays nothing.

// timelineSQL reads the server's current timeline from the name of the WAL
// file it writes (its first 8 hex digits), which any role may read, unlike
// pg_control_checkpoint(), and which changes the moment a standby is
// promoted, not at the next checkpoint.
const timelineSQL = `SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint`

// Replay is what a failover replay did.
type Replay struct {
	// From and To are the timelines before and after the promotion.
	From, To int64
	// Since is the start of the window replayed: dispatches at or after it
	// were made pending again.
	Since time.Time
	// Rows is how many.
	Rows int64
}

// CheckFailover compares the server's timeline with the one recorded for
// this outbox table and, when the server's is newer (a standby was promoted
// since), makes the events dispatched within RelayConfig.FailoverReplay of
// the last recorded dispatch pending again, in the same transaction as the
// new timeline is recorded, so that of several relays exactly one replays.
// The first check on an outbox table records its timeline and replays
// nothing. Relay.Run calls it at start and every few seconds; it returns a
// zero Replay when nothing was replayed.
func (r *Relay) CheckFailover(ctx context.Context) (Replay, error) {
	var res Replay
	if r.cfg.FailoverReplay <= 0 {
		return res, nil
	}
	// The check every few seconds is a read; only a difference opens the
	// transaction that locks the row and replays.
	var current int64
	var recorded *int64
	if err := r.pool.QueryRow(ctx, `SELECT (`+timelineSQL+`), (SELECT timeline FROM `+r.t.Timelines()+` WHERE outbox_table = $1)`, r.t.Key()).Scan(&current, &recorded); err != nil {
		return res, fmt.Errorf("reading the server's timeline and %s: %w", TimelineTable, err)
	}
	if recorded != nil && *recorded == current {
		return res, nil
	}
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, timelineSQL).Scan(&current); err != nil {
			return fmt.Errorf("reading the server's timeline: %w", err)
		}
		recorded = nil
		err := tx.QueryRow(ctx, `SELECT timeline FROM `+r.t.Timelines()+` WHERE outbox_table = $1 FOR UPDATE`, r.t.Key()).Scan(&recorded)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// First sight of this outbox table: nothing to compare with.
			_, err = tx.Exec(ctx, `INSERT INTO `+r.t.Timelines()+` (outbox_table, timeline) VALUES ($1, $2) ON CONFLICT (outbox_table) DO NOTHING`, r.t.Key(), current)
			return err
		case err != nil:
			return fmt.Errorf("reading %s: %w", TimelineTable, err)
		case *recorded == current:
			return nil // another relay recorded it first
		case *recorded > current:
			// A server restored from a backup older than the last
			// promotion: there is nothing to replay onto it.
			_, err = tx.Exec(ctx, `UPDATE `+r.t.Timelines()+` SET timeline = $2, recorded_at = now() WHERE outbox_table = $1`, r.t.Key(), current)
			return err
		}
		res.From, res.To = *recorded, current
		if err := r.replay(ctx, tx, &res); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE `+r.t.Timelines()+` SET timeline = $2, recorded_at = now(), replayed_at = now(), replayed_rows = $3, replayed_from = $4 WHERE outbox_table = $1`,
			r.t.Key(), current, res.Rows, res.From); err != nil {
			return fmt.Errorf("recording the timeline in %s: %w", TimelineTable, err)
		}
		return nil
	})
	if err != nil {
		return Replay{}, err
	}
	if res.To != 0 {
		r.replayed.Add(res.Rows)
		r.logger.Warn("the database was promoted since the last dispatch (a failover): events dispatched just before it are relayed again, and the consumers' ledger drops those whose effect survived",
			"from_timeline", res.From, "to_timeline", res.To, "events", res.Rows, "window", r.cfg.FailoverReplay)
		r.Wake()
	}
	return res, nil
}

// replay makes the events dispatched in the window before the last
// dispatch the new primary knows pending again, in tx.
func (r *Relay) replay(ctx context.Context, tx pgx.Tx, res *Replay) error {
	// The anchor is the newest dispatch the new primary knows, not now():
	// the relay may come back long after the promotion. Rows the position
	// passed carry no dispatch time of their own: the position's last
	// move stands for theirs, and their creation decides whether they
	// fall in the window (they are passed moments after their commit
	// unless a backlog waited). One sequential scan, once per failover.
	var newest *time.Time
	if err := tx.QueryRow(ctx, `SELECT greatest((SELECT max(dispatched_at) FROM `+r.t.Quoted()+` WHERE NOT shadowed),
		(SELECT moved_at FROM `+r.t.latestPosition()+` rp))`).Scan(&newest); err != nil {
		return fmt.Errorf("finding the last dispatch before the failover: %w", err)
	}
	if newest == nil {
		return nil
	}
	res.Since = newest.Add(-r.cfg.FailoverReplay)
	tag, err := tx.Exec(ctx, `UPDATE `+r.t.Quoted()+` o SET dispatched_at = NULL, available_at = now(), slow = true
		WHERE NOT o.shadowed AND (o.dispatched_at >= $1
		   OR `+r.t.passedUnmarked("o", "o.created_at >= $1")+`)`, res.Since)
	if err != nil {
		return fmt.Errorf("making the events dispatched before the failover pending again: %w", err)
	}
	res.Rows = tag.RowsAffected()
	return nil
}

// failoverUnknown is the log line of a failed CheckFailover.
const failoverUnknown = "relay could not check the database's timeline for a failover"

// TimelineRecord is what the relay recorded of the server's timeline
// (ferry_relay_timelines): the timeline it last saw and its last replay.
type TimelineRecord struct {
	Timeline int64
	// ReplayedFrom is the timeline the last replay left, nil before any.
	ReplayedFrom *int64
	ReplayedRows *int64
	ReplayedAt   *time.Time
}

// Timeline reads what the relay of t recorded of the server's timeline;
// pgx.ErrNoRows before a relay of t ran on it.
func (t Table) Timeline(ctx context.Context, q Reader) (TimelineRecord, error) {
	var r TimelineRecord
	err := q.QueryRow(ctx, `SELECT timeline, replayed_from, replayed_rows, replayed_at FROM `+t.Timelines()+` WHERE outbox_table = $1`, t.Key()).
		Scan(&r.Timeline, &r.ReplayedFrom, &r.ReplayedRows, &r.ReplayedAt)
	return r, err
}
