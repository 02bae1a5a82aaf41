package pgstatus

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
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
	// WaitingBehind says, of an intent at the broker, which pause or held
	// partition keeps it from a handler that has not handled it.
	WaitingBehind []Wait `json:"waiting_behind,omitempty"`
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
func Intents(ctx context.Context, q pgx.Tx, t pgoutbox.Table, aggregateID string, ids []string, limit int) ([]Intent, time.Time, error) {
	var now time.Time
	rows, err := t.Intents(ctx, q, aggregateID, ids, limit)
	if err != nil {
		return nil, now, err
	}
	out := make([]Intent, len(rows))
	for i, r := range rows {
		out[i] = Intent{MessageID: r.MessageID, Topic: r.Topic, AggregateID: r.AggregateID, CreatedAt: r.CreatedAt, AvailableAt: r.AvailableAt,
			DispatchedAt: r.DispatchedAt, Dispatched: r.Dispatched, Attempts: r.Attempts, LastError: r.LastError,
			HandledBy: []Handled{}, Retrying: []RetryWait{}, Poisoned: []Poisoning{}}
	}
	idx := map[string]*Intent{}
	ids = make([]string, 0, len(out))
	for i := range out {
		idx[out[i].MessageID] = &out[i]
		ids = append(ids, out[i].MessageID)
	}
	handled, err := pgledger.HandledOf(ctx, q, ids, nil)
	if err != nil {
		return nil, now, err
	}
	for _, h := range handled {
		if s := idx[h.MessageID]; s != nil {
			s.HandledBy = append(s.HandledBy, Handled{Handler: h.Consumer, At: h.ProcessedAt})
		}
	}
	retries, err := t.WaitingRetries(ctx, q, ids)
	if err != nil {
		return nil, now, err
	}
	for _, r := range retries {
		if s := idx[r.MessageID]; s != nil {
			s.Retrying = append(s.Retrying, RetryWait{Handler: r.Headers[pipeline.MetaRetryQueue], Attempt: r.Headers[pipeline.MetaAttempt],
				LastError: r.Headers[pipeline.MetaLastError], Due: r.AvailableAt})
		}
	}
	poisonings, err := pgpoison.PoisoningsOf(ctx, q, ids)
	if err != nil {
		return nil, now, err
	}
	for _, p := range poisonings {
		if s := idx[p.MessageID]; s != nil {
			s.Poisoned = append(s.Poisoned, Poisoning{Handler: p.Handler, Reason: p.Reason, At: p.At})
		}
	}
	w, err := readWaits(ctx, q)
	if err != nil {
		return nil, now, err
	}
	for i := range out {
		s := &out[i]
		if !s.Dispatched || len(s.Poisoned) > 0 {
			continue
		}
		handled := map[string]bool{}
		for _, h := range s.HandledBy {
			handled[h.Handler] = true
		}
		for _, r := range s.Retrying {
			handled[r.Handler] = true // its wait is the retry's, shown there
		}
		s.WaitingBehind = w.of(s.Topic, s.AggregateID, s.MessageID, handled)
	}
	if err := q.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return nil, now, err
	}
	return out, now, nil
}
