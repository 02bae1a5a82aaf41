// Package pgheld owns the ordered partitions held behind a failing head
// (ferry_held_partitions, migration 00016): the consumer's durable retry
// link records a hold as it sleeps out a head's backoff (Store, on the
// consumer's hot path), operators read it (List, Head, ByMessage) and ask
// for a retry now, of one partition or of a route's every held partition
// at once (RetryNow, RetryRoute), and a hold whose consumer never came
// back is pruned with its copy of the head (PruneStale).
package pgheld

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
)

// Table is the held partitions' table.
const Table = "ferry_held_partitions"

// StaleRetention is how long a hold lasts without being refreshed: its
// consumer refreshes it at every attempt (a backoff is at most
// pipeline's 4 minutes), so one older than this belongs to a consumer that
// died or was renamed, and is neither shown nor kept.
const StaleRetention = time.Hour

// Partition is an ordered partition waiting behind a head message that
// keeps failing.
type Partition struct {
	Consumer  string    `json:"consumer"`
	MessageID string    `json:"message_id"`
	Since     time.Time `json:"since"`
	Attempt   int       `json:"next_attempt"`
	LastError string    `json:"last_error"`
	UpdatedAt time.Time `json:"updated_at"`
}

// Route is the route (handler) whose partition p is.
func (p Partition) Route() string { return pipeline.RouteName(p.Consumer) }

// HeadMessage is a held partition with its head's payload and headers
// (as they were at its first failure).
type HeadMessage struct {
	Partition
	Payload        []byte            `json:"payload"`
	Headers        map[string]string `json:"headers"`
	RetryRequested *time.Time        `json:"retry_requested_at"`
}

// ErrNotHeld is returned by Head and RetryNow for a partition not held
// (any more) behind that message.
var ErrNotHeld = errors.New("this partition is not held behind that message (any more): its head was handled, poisoned, or its consumer moved on")

// RetryNowAction is the audit log's action of RetryNow and RetryRoute.
const RetryNowAction = "partition.retry-now"

// Reader is a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

const columns = `consumer, message_id, since, attempt, last_error, updated_at`

// live keeps the holds not released and refreshed within StaleRetention.
var live = `released_at IS NULL AND updated_at > now() - ` + fmt.Sprint(StaleRetention.Microseconds()) + ` * interval '1 microsecond'`

// SameOutage is how long after a release a new hold of the partition is
// the same outage, its clock going on: a head poisoned after its last
// attempt and the next one failing in turn.
const SameOutage = 2 * time.Minute

// List returns the partitions held now, the longest held first.
func List(ctx context.Context, q Reader) ([]Partition, error) {
	rows, err := q.Query(ctx, `SELECT `+columns+` FROM `+Table+` WHERE `+live+` ORDER BY since, consumer`)
	if err != nil {
		return nil, fmt.Errorf("reading held partitions: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Partition])
}

// ByMessage returns the holds whose head is one of messageIDs (for "where
// is this message?").
func ByMessage(ctx context.Context, q Reader, messageIDs []string) ([]Partition, error) {
	rows, err := q.Query(ctx, `SELECT `+columns+` FROM `+Table+` WHERE message_id = ANY($1) AND released_at IS NULL ORDER BY since, consumer`, messageIDs)
	if err != nil {
		return nil, fmt.Errorf("reading held partitions: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Partition])
}

// Head returns consumer's hold with its head, or ErrNotHeld.
func Head(ctx context.Context, q Reader, consumer string) (HeadMessage, error) {
	var h HeadMessage
	err := q.QueryRow(ctx, `SELECT `+columns+`, coalesce(payload, ''::bytea), coalesce(headers, '{}'), retry_requested_at
		FROM `+Table+` WHERE consumer = $1 AND `+live, consumer).Scan(
		&h.Consumer, &h.MessageID, &h.Since, &h.Attempt, &h.LastError, &h.UpdatedAt, &h.Payload, &h.Headers, &h.RetryRequested)
	if errors.Is(err, pgx.ErrNoRows) {
		return h, ErrNotHeld
	}
	if err != nil {
		return h, fmt.Errorf("reading a held partition: %w", err)
	}
	return h, nil
}

// RetryNow asks the consumer holding consumer's partition behind messageID
// to try it again now instead of sleeping out its backoff (it looks every
// second), and records who asked in the audit log. The try counts as an
// attempt, as any other.
func RetryNow(ctx context.Context, pool *pgxpool.Pool, consumer, messageID, actor string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE `+Table+` SET retry_requested_at = now() WHERE consumer = $1 AND message_id = $2 AND `+live, consumer, messageID)
		if err != nil {
			return fmt.Errorf("asking for a retry: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return ErrNotHeld
		}
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: RetryNowAction, Scope: "partition " + consumer, Count: 1,
			Detail: map[string]any{"message_ids": []string{messageID}}})
	})
}

// RetryRoute asks every held partition of route to try its head again now
// (one outage holds a partition per aggregate hash: eight clicks were
// eight requests), in one transaction with one audit entry naming the
// heads, and returns the holds it asked. heads, if not nil, are the
// consumer → head message pairs an operator was shown: a partition that
// has moved on to another head since is left alone.
func RetryRoute(ctx context.Context, pool *pgxpool.Pool, route, actor string, heads map[string]string) ([]Partition, error) {
	var asked []Partition
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// The route's holds, locked: a partition's head cannot change
		// between the comparison with what was shown and the request.
		rows, err := tx.Query(ctx, `SELECT `+columns+` FROM `+Table+`
			WHERE (consumer = $1 OR consumer LIKE $2) AND `+live+` ORDER BY consumer FOR UPDATE`, route, likeEscape(route)+"@%")
		if err != nil {
			return fmt.Errorf("reading the route's held partitions: %w", err)
		}
		all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Partition])
		if err != nil {
			return err
		}
		var consumers []string
		for _, p := range all {
			if heads == nil || heads[p.Consumer] == p.MessageID {
				asked = append(asked, p)
				consumers = append(consumers, p.Consumer)
			}
		}
		if len(asked) == 0 {
			return nil
		}
		if _, err := tx.Exec(ctx, `UPDATE `+Table+` SET retry_requested_at = now() WHERE consumer = ANY($1)`, consumers); err != nil {
			return fmt.Errorf("asking for a retry: %w", err)
		}
		ids := make([]string, len(asked))
		for i, p := range asked {
			ids[i] = p.Consumer + " " + p.MessageID
		}
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: RetryNowAction, Scope: "route " + route, Count: len(asked),
			Detail: map[string]any{"heads": ids}})
	})
	if err != nil {
		return nil, err
	}
	return asked, nil
}

// likeEscape escapes LIKE's wildcards in s.
func likeEscape(s string) string {
	var b []byte
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '%' || c == '_' || c == '\\' {
			b = append(b, '\\')
		}
		b = append(b, s[i])
	}
	return string(b)
}

// PruneStale removes the holds not refreshed within StaleRetention, with
// their copies of the head's payload and headers (a consumer that died
// during a hold, or was renamed, never releases it), and the released ones
// past SameOutage. Returns how many.
func PruneStale(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	tag, err := pool.Exec(ctx, `DELETE FROM `+Table+` WHERE updated_at <= now() - $1 * interval '1 microsecond'
		OR released_at < now() - $2 * interval '1 microsecond'`, StaleRetention.Microseconds(), SameOutage.Microseconds())
	if err != nil {
		return 0, fmt.Errorf("pruning stale holds: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Store records held partitions for the durable retry link
// (middleware.PartitionHolds and the interfaces beside it).
type Store struct{ Pool *pgxpool.Pool }

// Held records (or refreshes) consumer's hold of messageID, to be tried
// next at retryAt. The hold's since is one clock for the outage, across
// heads: it stays while the partition is held (by this head or the next)
// and when it was released less than SameOutage ago; since is used only
// for a new outage.
func (s Store) Held(ctx context.Context, consumer, messageID string, attempt int, since, retryAt time.Time, lastError string) error {
	// A new head's page shows its own payload, and an operator's "retry
	// now" for the last head is not carried over.
	t := Table
	_, err := s.Pool.Exec(ctx, `INSERT INTO `+t+` (consumer, message_id, since, attempt, last_error, retry_at) VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (consumer) DO UPDATE SET message_id = $2,
		since = CASE WHEN `+t+`.released_at IS NULL OR `+t+`.released_at > now() - $7 * interval '1 microsecond' THEN least(`+t+`.since, $3) ELSE $3 END,
		payload = CASE WHEN `+t+`.message_id = $2 AND `+t+`.released_at IS NULL THEN `+t+`.payload END,
		headers = CASE WHEN `+t+`.message_id = $2 AND `+t+`.released_at IS NULL THEN `+t+`.headers END,
		retry_requested_at = CASE WHEN `+t+`.message_id = $2 AND `+t+`.released_at IS NULL THEN `+t+`.retry_requested_at END,
		attempt = $4, last_error = $5, retry_at = $6, released_at = NULL, updated_at = now()`,
		pipeline.CleanText(consumer, 200), pipeline.CleanText(messageID, 512), since, attempt, pipeline.CleanText(lastError, 1024), retryAt,
		SameOutage.Microseconds())
	return err
}

// HeldAttempt returns the attempt, the start and the next try of
// consumer's hold of messageID, if it holds that message
// (middleware.PartitionResumer): a head delivered again after a stop
// resumes its attempts, and waits for its next try.
func (s Store) HeldAttempt(ctx context.Context, consumer, messageID string) (attempt int, since, retryAt time.Time, ok bool, err error) {
	var at *time.Time
	err = s.Pool.QueryRow(ctx, `SELECT attempt, since, retry_at FROM `+Table+` WHERE consumer = $1 AND message_id = $2 AND released_at IS NULL`,
		pipeline.CleanText(consumer, 200), pipeline.CleanText(messageID, 512)).Scan(&attempt, &since, &at)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, time.Time{}, time.Time{}, false, nil
	}
	if at != nil {
		retryAt = *at
	}
	return attempt, since, retryAt, err == nil, err
}

// KeepHead keeps the held head's payload and headers for its page
// (middleware.PartitionHeadKeeper), once per head.
func (s Store) KeepHead(ctx context.Context, consumer, messageID string, payload []byte, headers map[string]string) error {
	_, err := s.Pool.Exec(ctx, `UPDATE `+Table+` SET payload = $3, headers = $4 WHERE consumer = $1 AND message_id = $2 AND payload IS NULL`,
		pipeline.CleanText(consumer, 200), pipeline.CleanText(messageID, 512), payload, headers)
	return err
}

// RetryRequested reports whether an operator asked to retry consumer's
// held head messageID now (RetryNow, RetryRoute), and takes the request
// (middleware.PartitionRetrier).
func (s Store) RetryRequested(ctx context.Context, consumer, messageID string) (bool, error) {
	tag, err := s.Pool.Exec(ctx, `UPDATE `+Table+` SET retry_requested_at = NULL
		WHERE consumer = $1 AND message_id = $2 AND retry_requested_at IS NOT NULL`, pipeline.CleanText(consumer, 200), pipeline.CleanText(messageID, 512))
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// Released ends consumer's hold: its copy of the head goes, and the row
// stays SameOutage as the outage's clock, should the next head fail too.
func (s Store) Released(ctx context.Context, consumer string) error {
	_, err := s.Pool.Exec(ctx, `UPDATE `+Table+` SET released_at = now(), payload = NULL, headers = NULL, retry_requested_at = NULL, retry_at = NULL
		WHERE consumer = $1`, pipeline.CleanText(consumer, 200))
	return err
}
