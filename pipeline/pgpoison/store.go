package pgpoison

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Record is one poisoned message.
type Record struct {
	ID            int64             `json:"id"`
	MessageID     string            `json:"message_id"`
	Topic         string            `json:"topic"`
	Handler       string            `json:"handler"`
	Consumer      string            `json:"consumer"`
	AggregateID   string            `json:"aggregate_id"`
	Payload       []byte            `json:"-"`
	PayloadText   string            `json:"payload"`
	Headers       map[string]string `json:"headers"`
	Reason        string            `json:"reason"`
	Permanent     bool              `json:"permanent"`
	Attempts      int               `json:"attempts"`
	FirstFailedAt time.Time         `json:"first_failed_at"`
	LastFailedAt  time.Time         `json:"last_failed_at"`
	PoisonedAt    time.Time         `json:"poisoned_at"`
	CorrelationID string            `json:"correlation_id"`
}

// Selector chooses poisoned messages: exactly one of IDs, Topic or All.
type Selector struct {
	IDs   []int64
	Topic string
	All   bool
	// Limit caps how many are chosen (oldest first); 0 means no cap.
	Limit int
}

// Validate rejects a selector that names nothing, or more than one thing.
func (s Selector) Validate() error {
	n := 0
	if len(s.IDs) > 0 {
		n++
	}
	if s.Topic != "" {
		n++
	}
	if s.All {
		n++
	}
	if n != 1 {
		return errors.New("select the messages with exactly one of --id, --topic or --all")
	}
	if s.Limit < 0 {
		return errors.New("limit must not be negative")
	}
	return nil
}

// Store reads and acts on the poison store.
type Store struct {
	pool   *pgxpool.Pool
	outbox *pgoutbox.Outbox
}

// NewStore returns the store over pool, requeueing through outbox (the one
// INSERT path into the outbox).
func NewStore(pool *pgxpool.Pool, outbox *pgoutbox.Outbox) (*Store, error) {
	if pool == nil || outbox == nil {
		return nil, errors.New("pgpoison: NewStore needs a pool and an outbox")
	}
	return &Store{pool: pool, outbox: outbox}, nil
}

const columns = `id, message_id, topic, handler, consumer, aggregate_id, payload, headers, reason, permanent,
	attempts, first_failed_at, last_failed_at, poisoned_at, correlation_id`

func scanRecords(rows pgx.Rows) ([]Record, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) {
		var r Record
		err := row.Scan(&r.ID, &r.MessageID, &r.Topic, &r.Handler, &r.Consumer, &r.AggregateID, &r.Payload, &r.Headers,
			&r.Reason, &r.Permanent, &r.Attempts, &r.FirstFailedAt, &r.LastFailedAt, &r.PoisonedAt, &r.CorrelationID)
		r.PayloadText = string(r.Payload)
		return r, err
	})
}

// List returns poisoned messages, oldest first, of topic (all when empty), at most limit (all when 0).
func (s *Store) List(ctx context.Context, topic string, limit int) ([]Record, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+columns+` FROM `+Table+`
		WHERE ($1 = '' OR topic = $1) ORDER BY id LIMIT NULLIF($2, 0)`, topic, limit)
	if err != nil {
		return nil, fmt.Errorf("listing poisoned messages: %w", err)
	}
	return scanRecords(rows)
}

// Depth counts poisoned messages per topic.
func (s *Store) Depth(ctx context.Context) (map[string]int, error) { return Depth(ctx, s.pool) }

// Depth counts the poisoned messages in pool's store, per original topic.
func Depth(ctx context.Context, pool *pgxpool.Pool) (map[string]int, error) {
	rows, err := pool.Query(ctx, `SELECT topic, count(*) FROM `+Table+` GROUP BY topic`)
	if err != nil {
		return nil, fmt.Errorf("counting poisoned messages: %w", err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var t string
		var n int
		if err := rows.Scan(&t, &n); err != nil {
			return nil, err
		}
		out[t] = n
	}
	return out, rows.Err()
}

func (s *Store) selectTx(ctx context.Context, tx pgx.Tx, sel Selector) ([]Record, error) {
	if err := sel.Validate(); err != nil {
		return nil, err
	}
	rows, err := tx.Query(ctx, `SELECT `+columns+` FROM `+Table+`
		WHERE (coalesce(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1)) AND ($2 = '' OR topic = $2)
		ORDER BY id LIMIT NULLIF($3, 0) FOR UPDATE`, sel.IDs, sel.Topic, sel.Limit)
	if err != nil {
		return nil, fmt.Errorf("selecting poisoned messages: %w", err)
	}
	return scanRecords(rows)
}

// Skipped is a message Requeue left in the store, and why.
type Skipped struct {
	Record Record `json:"record"`
	Why    string `json:"why"`
}

// RequeueResult says what Requeue did (or, dry, would do).
type RequeueResult struct {
	Requeued []Record  `json:"requeued"`
	Skipped  []Skipped `json:"skipped"`
	// MessageIDs are the requeued messages' ids: the UUIDs of the new
	// outbox rows (message_uuid), one per requeued message.
	MessageIDs []string `json:"message_ids"`
	DryRun     bool     `json:"dry_run"`
}

// Requeue sends the selected messages back to their original topic: in one
// transaction it writes each into the outbox (message id kept, attempt
// count reset, failure bookkeeping dropped) and deletes it here. Handlers
// that had already processed the message skip it through their ledger; the
// one that failed runs it. Payloads go back byte for byte, JSON or not.
func (s *Store) Requeue(ctx context.Context, sel Selector, dryRun bool) (RequeueResult, error) {
	res := RequeueResult{DryRun: dryRun}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		recs, err := s.selectTx(ctx, tx, sel)
		if err != nil {
			return err
		}
		for _, r := range recs {
			res.Requeued = append(res.Requeued, r)
			if dryRun {
				continue
			}
			headers := map[string]string{}
			for k, v := range r.Headers {
				if !slices.Contains(bookkeeping, k) {
					headers[k] = v
				}
			}
			headers[pipeline.MetaMessageID] = r.MessageID
			headers["ferry_requeued_from_poison_id"] = fmt.Sprint(r.ID)
			// The same message again: its UUID is its id, as at first.
			msg := message.NewMessage(r.MessageID, r.Payload)
			for k, v := range headers {
				msg.Metadata.Set(k, v)
			}
			msg.Metadata.Set(pipeline.MetaAggregateID, r.AggregateID)
			if err := s.outbox.PublishTx(ctx, pgoutbox.PgxTx(tx), r.Topic, msg); err != nil {
				return fmt.Errorf("requeueing poisoned message %d into the outbox: %w", r.ID, err)
			}
			if _, err := tx.Exec(ctx, `DELETE FROM `+Table+` WHERE id = $1`, r.ID); err != nil {
				return fmt.Errorf("removing requeued message %d: %w", r.ID, err)
			}
			res.MessageIDs = append(res.MessageIDs, r.MessageID)
		}
		if dryRun {
			return errDryRun
		}
		return nil
	})
	if errors.Is(err, errDryRun) {
		err = nil
	}
	if err != nil {
		return RequeueResult{DryRun: dryRun}, err
	}
	return res, nil
}

var errDryRun = errors.New("dry run: roll back")

// Discard deletes the selected messages (or, dry, only says which).
func (s *Store) Discard(ctx context.Context, sel Selector, dryRun bool) ([]Record, error) {
	var out []Record
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		recs, err := s.selectTx(ctx, tx, sel)
		if err != nil {
			return err
		}
		out = recs
		if dryRun || len(recs) == 0 {
			return errDryRun
		}
		ids := make([]int64, len(recs))
		for i, r := range recs {
			ids[i] = r.ID
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+Table+` WHERE id = ANY($1)`, ids); err != nil {
			return fmt.Errorf("discarding poisoned messages: %w", err)
		}
		return nil
	})
	if errors.Is(err, errDryRun) {
		err = nil
	}
	return out, err
}
