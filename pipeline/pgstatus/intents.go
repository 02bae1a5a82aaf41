package pgstatus

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Intent is one event (an intent) and what became of it, as read from the
// outbox, the consumers' ledger and the poison store. State is left for
// the reader to decide (agent tools' intent_status).
type Intent struct {
	MessageID   string    `json:"message_id"`
	Topic       string    `json:"topic"`
	AggregateID string    `json:"aggregate_id,omitempty"`
	State       string    `json:"state" jsonschema:"pending, scheduled, retrying, dispatched, handled or poisoned"`
	CreatedAt   time.Time `json:"created_at"`
	AvailableAt time.Time `json:"available_at"`
	// Dispatched says the relay handed the intent to the broker; DispatchedAt
	// is when, where that is recorded (the relay's append-only lane passes
	// rows without writing a time per row).
	Dispatched   bool        `json:"dispatched"`
	DispatchedAt *time.Time  `json:"dispatched_at,omitempty"`
	Attempts     int         `json:"attempts" jsonschema:"relay attempts"`
	LastError    string      `json:"last_error,omitempty"`
	HandledBy    []Handled   `json:"handled_by"`
	Retrying     []RetryWait `json:"retrying"`
	Poisoned     []Poisoning `json:"poisoned"`
}

// Handled is one handler that processed an intent.
type Handled struct {
	Handler string    `json:"handler"`
	At      time.Time `json:"at"`
}

// RetryWait is a handler's durable retry waiting in the outbox.
type RetryWait struct {
	Handler   string    `json:"handler"`
	Attempt   string    `json:"next_attempt"`
	LastError string    `json:"last_error"`
	Due       time.Time `json:"due"`
}

// Poisoning is a handler that gave up on an intent.
type Poisoning struct {
	Handler string    `json:"handler"`
	Reason  string    `json:"reason"`
	At      time.Time `json:"at"`
}

// Intents reads, on q, the intents of one aggregate (aggregateID) or the
// ones with these message ids, oldest first, at most limit, with their
// handlers, durable retries and poisonings; and the database's now.
func Intents(ctx context.Context, q pgx.Tx, table, aggregateID string, ids []string, limit int) ([]Intent, time.Time, error) {
	var now time.Time
	t, err := pgoutbox.QuoteTable(table)
	if err != nil {
		return nil, now, err
	}
	// A row the relay sent at its first try keeps no attempt count of its
	// own (it was passed, not marked): its one attempt is counted here.
	dispatched := pgoutbox.DispatchedCond("o", t, table)
	rows, err := q.Query(ctx, `SELECT coalesce(message_uuid, id::text), topic, aggregate_id, created_at, available_at, dispatched_at, `+dispatched+`,
		CASE WHEN dispatched_at IS NULL AND attempts = 0 AND `+dispatched+` THEN 1 ELSE attempts END, coalesce(last_error, '')
		FROM `+t+` o WHERE topic <> $1 AND (CASE WHEN $2 <> '' THEN aggregate_id = $2 ELSE message_uuid = ANY($3) END)
		ORDER BY id LIMIT $4`, pipeline.RetryTopic, aggregateID, ids, limit)
	if err != nil {
		return nil, now, fmt.Errorf("reading intents: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Intent, error) {
		s := Intent{HandledBy: []Handled{}, Retrying: []RetryWait{}, Poisoned: []Poisoning{}}
		err := row.Scan(&s.MessageID, &s.Topic, &s.AggregateID, &s.CreatedAt, &s.AvailableAt, &s.DispatchedAt, &s.Dispatched, &s.Attempts, &s.LastError)
		return s, err
	})
	if err != nil {
		return nil, now, fmt.Errorf("reading intents: %w", err)
	}
	idx := map[string]*Intent{}
	ids = make([]string, 0, len(out))
	for i := range out {
		idx[out[i].MessageID] = &out[i]
		ids = append(ids, out[i].MessageID)
	}
	if err := scanInto(ctx, q, `SELECT message_id, consumer, processed_at FROM processed_messages WHERE message_id = ANY($1) ORDER BY processed_at`, ids,
		func(row pgx.Rows) error {
			var id string
			var h Handled
			if err := row.Scan(&id, &h.Handler, &h.At); err != nil {
				return err
			}
			if s := idx[id]; s != nil {
				s.HandledBy = append(s.HandledBy, h)
			}
			return nil
		}); err != nil {
		return nil, now, err
	}
	if err := scanInto(ctx, q, `SELECT message_uuid, coalesce(headers->>'`+pipeline.MetaRetryQueue+`', ''), coalesce(headers->>'`+pipeline.MetaAttempt+`', ''),
		coalesce(headers->>'`+pipeline.MetaLastError+`', ''), available_at FROM `+t+` o
		WHERE topic = '`+pipeline.RetryTopic+`' AND message_uuid = ANY($1) AND NOT `+pgoutbox.DispatchedCond("o", t, table)+` ORDER BY id`, ids,
		func(row pgx.Rows) error {
			var id string
			var r RetryWait
			if err := row.Scan(&id, &r.Handler, &r.Attempt, &r.LastError, &r.Due); err != nil {
				return err
			}
			if s := idx[id]; s != nil {
				s.Retrying = append(s.Retrying, r)
			}
			return nil
		}); err != nil {
		return nil, now, err
	}
	if err := scanInto(ctx, q, `SELECT message_id, handler, reason, poisoned_at FROM poison_messages WHERE message_id = ANY($1) ORDER BY id`, ids,
		func(row pgx.Rows) error {
			var id string
			var p Poisoning
			if err := row.Scan(&id, &p.Handler, &p.Reason, &p.At); err != nil {
				return err
			}
			if s := idx[id]; s != nil {
				s.Poisoned = append(s.Poisoned, p)
			}
			return nil
		}); err != nil {
		return nil, now, err
	}
	if err := q.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return nil, now, err
	}
	return out, now, nil
}

func scanInto(ctx context.Context, q pgx.Tx, sql string, ids []string, each func(pgx.Rows) error) error {
	if len(ids) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, sql, ids)
	if err != nil {
		return fmt.Errorf("reading intent state: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		if err := each(rows); err != nil {
			return err
		}
	}
	return rows.Err()
}
