// Package pgparked owns the events parked out of an ordered partition
// (ferry_parked, migration 00034), in a tenant fleet's control database:
// the partition's consumer parks an event whose tenant's database is out
// of reach, and every later event of that tenant in that partition behind
// it (Admit, Park), so the partition goes on with the other tenants; a
// sender takes each group back, in order, once the tenant answers
// (Groups, Send); the consumer removes an event once it was handled
// (Done), or parks it again in its place when the outage came back
// (Unsend).
//
// An event is parked per (consumer, tenant): the partition's order holds
// per aggregate, and every aggregate of the tenant in the partition waits
// behind the first parked event, which keeps the rule simple and the
// order exact.
package pgparked

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Table is the parked events' table.
const Table = "ferry_parked"

// ResendAfter is how long a parked event sent back to its partition may
// stay unhandled before it is sent again: its copy was lost with a queue
// deleted or purged. A copy that was only slow is handled twice, which
// the ledger makes a no-op.
const ResendAfter = 10 * time.Minute

// Event is one parked event.
type Event struct {
	Seq       int64             `json:"seq"`
	Consumer  string            `json:"consumer"`
	TenantID  string            `json:"tenant_id"`
	MessageID string            `json:"message_id"`
	Payload   []byte            `json:"payload"`
	Headers   map[string]string `json:"headers"`
	Reason    string            `json:"reason"`
	ParkedAt  time.Time         `json:"parked_at"`
	SentAt    *time.Time        `json:"sent_at,omitempty"`
}

// Group is the parked events of one tenant in one partition.
type Group struct {
	Consumer string `json:"consumer"`
	TenantID string `json:"tenant_id"`
	// Parked counts the group's events; Waiting those not sent back (or
	// sent too long ago).
	Parked  int       `json:"parked"`
	Waiting int       `json:"waiting"`
	Since   time.Time `json:"since"`
}

// Store is the parked events' table in the control database.
type Store struct {
	Pool *pgxpool.Pool
}

// Admit tells a partition's consumer whether a delivery of tenant must
// be parked behind the tenant's parked events rather than handled now. A
// new event (seq 0) is parked when the group holds any event; a parked
// event sent back (seq) when an event parked before it is still there
// (it was parked again: the outage came back). A sent-back event that is
// not there any more was handled already: it runs, and its ledger makes
// it a no-op.
func (s Store) Admit(ctx context.Context, consumer, tenant string, seq int64) (park bool, err error) {
	if seq <= 0 {
		err = s.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+Table+` WHERE consumer = $1 AND tenant_id = $2)`, consumer, tenant).Scan(&park)
	} else {
		err = s.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+Table+` WHERE seq = $3)
			AND EXISTS (SELECT 1 FROM `+Table+` WHERE consumer = $1 AND tenant_id = $2 AND seq < $3)`, consumer, tenant, seq).Scan(&park)
	}
	if err != nil {
		return false, fmt.Errorf("reading the parked events of tenant %q in %s: %w", tenant, consumer, err)
	}
	return park, nil
}

// Park appends an event behind its group's parked events. An event parked
// already (a delivery that came again) keeps its place.
func (s Store) Park(ctx context.Context, consumer, tenant, messageID string, payload []byte, headers map[string]string, reason string) error {
	h, err := json.Marshal(headers)
	if err != nil {
		return err
	}
	if _, err := s.Pool.Exec(ctx, `INSERT INTO `+Table+` (consumer, tenant_id, message_id, payload, headers, reason)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (consumer, tenant_id, message_id) DO NOTHING`,
		consumer, tenant, messageID, payload, h, reason); err != nil {
		return fmt.Errorf("parking message %s of tenant %q in %s: %w", messageID, tenant, consumer, err)
	}
	return nil
}

// Unsend parks a sent-back event again, in its place: it met the outage
// again, or arrived while one parked before it waits again.
// found is false when the event is not parked (any more).
func (s Store) Unsend(ctx context.Context, seq int64, reason string) (found bool, err error) {
	tag, err := s.Pool.Exec(ctx, `UPDATE `+Table+` SET sent_at = NULL, reason = CASE WHEN $2 = '' THEN reason ELSE $2 END WHERE seq = $1`, seq, reason)
	if err != nil {
		return false, fmt.Errorf("parking event %d again: %w", seq, err)
	}
	return tag.RowsAffected() > 0, nil
}

// Done removes a sent-back event its partition has handled (or failed for
// a reason of its own, which the partition's hold and poison store now
// carry).
func (s Store) Done(ctx context.Context, seq int64) error {
	if _, err := s.Pool.Exec(ctx, `DELETE FROM `+Table+` WHERE seq = $1`, seq); err != nil {
		return fmt.Errorf("removing parked event %d: %w", seq, err)
	}
	return nil
}

// Groups returns the groups holding parked events, the oldest first; with
// waiting, only those with an event to send back.
func (s Store) Groups(ctx context.Context, waiting bool) ([]Group, error) {
	filter := ""
	if waiting {
		filter = ` HAVING count(*) FILTER (WHERE ` + unsent + `) > 0`
	}
	rows, err := s.Pool.Query(ctx, `SELECT consumer, tenant_id, count(*), count(*) FILTER (WHERE `+unsent+`), min(parked_at)
		FROM `+Table+` GROUP BY consumer, tenant_id`+filter+` ORDER BY min(parked_at)`)
	if err != nil {
		return nil, fmt.Errorf("reading the parked events: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (g Group, err error) {
		err = r.Scan(&g.Consumer, &g.TenantID, &g.Parked, &g.Waiting, &g.Since)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading the parked events: %w", err)
	}
	return out, nil
}

// Reader is a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ByMessage returns the parked events of the messages ids, for ferry
// find (without their payloads).
func ByMessage(ctx context.Context, q Reader, ids []string) ([]Event, error) {
	rows, err := q.Query(ctx, `SELECT seq, consumer, tenant_id, message_id, reason, parked_at, sent_at FROM `+Table+`
		WHERE message_id = ANY($1) ORDER BY seq`, ids)
	if err != nil {
		return nil, fmt.Errorf("reading the parked events: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (e Event, err error) {
		err = r.Scan(&e.Seq, &e.Consumer, &e.TenantID, &e.MessageID, &e.Reason, &e.ParkedAt, &e.SentAt)
		return e, err
	})
}

// unsent are the events to send back: not sent, or sent ResendAfter ago.
var unsent = `(sent_at IS NULL OR sent_at < now() - ` + fmt.Sprint(ResendAfter.Microseconds()) + ` * interval '1 microsecond')`

// ErrBusy is returned by Send when another process is sending the group.
var ErrBusy = errors.New("another process is sending this group back")

// SendLimit is how many events one Send takes back at most.
const SendLimit = 500

// Send takes back up to SendLimit of g's events to send, in order, and
// hands them to send; those are marked sent when send succeeds. One
// process at a time sends a group (ErrBusy for the others), so that two
// senders never interleave a group's events in the partition's queue.
func (s Store) Send(ctx context.Context, g Group, send func(ctx context.Context, events []Event) error) (int, error) {
	tx, err := s.Pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var mine bool
	if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtext('`+Table+`'), hashtext($1 || '/' || $2))`, g.Consumer, g.TenantID).Scan(&mine); err != nil {
		return 0, err
	}
	if !mine {
		return 0, ErrBusy
	}
	rows, err := tx.Query(ctx, `SELECT seq, consumer, tenant_id, message_id, payload, headers, reason, parked_at, sent_at FROM `+Table+`
		WHERE consumer = $1 AND tenant_id = $2 AND `+unsent+` ORDER BY seq LIMIT `+fmt.Sprint(SendLimit), g.Consumer, g.TenantID)
	if err != nil {
		return 0, err
	}
	events, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (e Event, err error) {
		err = r.Scan(&e.Seq, &e.Consumer, &e.TenantID, &e.MessageID, &e.Payload, &e.Headers, &e.Reason, &e.ParkedAt, &e.SentAt)
		return e, err
	})
	if err != nil || len(events) == 0 {
		return 0, err
	}
	if err := send(ctx, events); err != nil {
		return 0, err
	}
	seqs := make([]int64, len(events))
	for i, e := range events {
		seqs[i] = e.Seq
	}
	if _, err := tx.Exec(ctx, `UPDATE `+Table+` SET sent_at = now() WHERE seq = ANY($1)`, seqs); err != nil {
		return 0, err
	}
	return len(events), tx.Commit(ctx)
}
