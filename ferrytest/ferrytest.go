// Package ferrytest is the test package of a service built on Ferry, in
// the spirit of River's rivertest: start the service's app in a schema and
// a broker namespace of its own (App), get a migrated schema or a broker
// configuration for lower-level tests (Postgres, Schema, Rabbit), assert
// that a transaction published an event, wait until the outbox is drained
// and every event handled, and run one route's handler on a message in a
// unit test. The servers are FERRY_TEST_DATABASE_URL and
// FERRY_TEST_AMQP_URL (defaults: the local PostgreSQL's database test and
// the local RabbitMQ); an unreachable one fails the test, saying so, and
// only `go test -short` skips such tests.
package ferrytest

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// Published is one outbox row as a test sees it.
type Published struct {
	ID          int64
	Topic       string
	AggregateID string
	// Msg is the message as the relay will publish it: UUID, payload bytes
	// and metadata (headers).
	Msg         *message.Message
	AvailableAt time.Time
}

// publishedSQL reads what a transaction can see of the outbox's pending
// rows (its view): its own uncommitted rows included.
func publishedSQL() string {
	return `SELECT id, coalesce(message_uuid, id::text), topic, aggregate_id,
	COALESCE(payload_raw, convert_to(payload::text, 'UTF8')), headers, available_at
	FROM ` + outboxTable().View(pgoutbox.StatePending) + ` o WHERE ($1 = '' OR topic = $1) ORDER BY id`
}

// PublishedTx returns the pending outbox rows of topic ("" for every
// topic) that tx sees, its own uncommitted ones included. tx is a *sql.Tx,
// a pgx.Tx, a *sql.DB or a *pgxpool.Pool.
func PublishedTx(t testing.TB, tx any, topic string) []Published {
	t.Helper()
	var (
		out     []Published
		id      int64
		uuid    string
		tp, agg string
		payload []byte
		headers []byte
		at      time.Time
	)
	dest := []any{&id, &uuid, &tp, &agg, &payload, &headers, &at}
	// add turns the row just scanned into dest into a Published.
	add := func() error {
		h := map[string]any{}
		if err := json.Unmarshal(headers, &h); err != nil {
			return fmt.Errorf("decoding headers of outbox row %d: %w", id, err)
		}
		msg := message.NewMessage(uuid, slices.Clone(payload))
		for k, v := range h {
			s, ok := v.(string)
			if !ok {
				b, _ := json.Marshal(v)
				s = string(b)
			}
			msg.Metadata.Set(k, s)
		}
		if agg != "" {
			msg.Metadata.Set(pipeline.MetaAggregateID, agg)
		}
		out = append(out, Published{ID: id, Topic: tp, AggregateID: agg, Msg: msg, AvailableAt: at})
		return nil
	}
	ctx := context.Background()
	var err error
	switch q := tx.(type) {
	case interface {
		QueryContext(context.Context, string, ...any) (*sql.Rows, error)
	}:
		var rows *sql.Rows
		if rows, err = q.QueryContext(ctx, publishedSQL(), topic); err == nil {
			for rows.Next() && err == nil {
				if err = rows.Scan(dest...); err == nil {
					err = add()
				}
			}
			err = errors.Join(err, rows.Err(), rows.Close())
		}
	case interface {
		Query(context.Context, string, ...any) (pgx.Rows, error)
	}:
		var rows pgx.Rows
		if rows, err = q.Query(ctx, publishedSQL(), topic); err == nil {
			_, err = pgx.ForEachRow(rows, dest, add)
		}
	default:
		t.Fatalf("ferrytest: PublishedTx needs a *sql.Tx, pgx.Tx, *sql.DB or *pgxpool.Pool, got %T", tx)
	}
	if err != nil {
		t.Fatalf("ferrytest: reading the outbox: %v", err)
	}
	return out
}

// RequirePublishedTx asserts that tx published an event on topic whose
// JSON payload contains want: every field of want (marshalled to JSON) with
// the same value, other fields ignored. It returns the first such event; a
// nil want matches any payload.
func RequirePublishedTx(t testing.TB, tx any, topic string, want any) Published {
	t.Helper()
	rows := PublishedTx(t, tx, topic)
	var wantJSON any
	if want != nil {
		b, err := json.Marshal(want)
		if err != nil {
			t.Fatalf("ferrytest: encoding the expected payload: %v", err)
		}
		_ = json.Unmarshal(b, &wantJSON)
	}
	var seen []string
	for _, p := range rows {
		var got any
		if json.Unmarshal(p.Msg.Payload, &got) != nil && want != nil {
			seen = append(seen, fmt.Sprintf("%s (not JSON)", p.Msg.UUID))
			continue
		}
		if want == nil || contains(got, wantJSON) {
			return p
		}
		seen = append(seen, string(p.Msg.Payload))
	}
	t.Fatalf("ferrytest: no event on topic %q with a payload containing %v; the transaction published %d on it: %s",
		topic, wantJSON, len(rows), strings.Join(seen, ", "))
	return Published{}
}

// contains reports whether got has every field of want with equal values
// (recursively for objects; arrays and scalars must be equal).
func contains(got, want any) bool {
	wm, ok := want.(map[string]any)
	if !ok {
		gb, _ := json.Marshal(got)
		wb, _ := json.Marshal(want)
		return string(gb) == string(wb)
	}
	gm, ok := got.(map[string]any)
	if !ok {
		return false
	}
	for k, wv := range wm {
		gv, ok := gm[k]
		if !ok || !contains(gv, wv) {
			return false
		}
	}
	return true
}

// RequireHandled waits until the outbox has no due row left and every
// dispatched event on the topics of routes has been handled by each of
// those routes (its ledger row) or poisoned by it, failing the test after
// timeout with what is still missing.
func RequireHandled(t testing.TB, pool *pgxpool.Pool, routes []handlers.Route, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		missing, err := unhandled(pool, routes)
		if err != nil {
			t.Fatalf("ferrytest: %v", err)
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("ferrytest: not handled after %s: %s", timeout, strings.Join(missing, "; "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func unhandled(pool *pgxpool.Pool, routes []handlers.Route) ([]string, error) {
	ctx := context.Background()
	var missing []string
	due, err := outboxTable().CountPending(ctx, pool, pgoutbox.PendingFilter{Due: true})
	if err != nil {
		return nil, err
	}
	if due > 0 {
		missing = append(missing, strconv.FormatInt(due, 10)+" outbox row(s) still due")
	}
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	if err != nil {
		return nil, err
	}
	for _, r := range routes {
		sent, err := outboxTable().SentMessageIDs(ctx, pool, r.Topic)
		if err != nil {
			return nil, err
		}
		left, err := ledger.Unprocessed(ctx, r.Name, sent)
		if err != nil {
			return nil, fmt.Errorf("checking what %s handled: %w", r.Name, err)
		}
		if len(left) > 0 {
			if left, err = pgpoison.NotPoisoned(ctx, pool, r.Name, left); err != nil {
				return nil, fmt.Errorf("checking what %s handled: %w", r.Name, err)
			}
		}
		if len(left) > 0 {
			missing = append(missing, fmt.Sprintf("%s: %d event(s) on %s not handled", r.Name, len(left), r.Topic))
		}
	}
	return missing, nil
}

// RunConfig configures RunRoute.
type RunConfig struct {
	// Ledger, if set, runs the handler inside Ferry's idempotency link: a
	// real ledger transaction (pgledger.TxFromContext works) and duplicate
	// suppression. Default: no ledger, no database.
	Ledger middleware.Ledger
	// Timeout bounds the run. Default 10s.
	Timeout time.Duration
}

// RunRoute runs route's handler, inside its own middleware, on msg, on a
// real Watermill router over Watermill's in-memory Pub/Sub, and returns
// what the handler chain returned. The handler sees what it sees in
// production: its route name as the handler name (handlers.IdempotencyKey
// works), the message's metadata, its context.
func RunRoute(t testing.TB, route handlers.Route, msg *message.Message, cfg RunConfig) error {
	t.Helper()
	if err := route.Validate(); err != nil {
		t.Fatalf("ferrytest: %v", err)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatalf("ferrytest: %v", err)
	}
	result := make(chan error, 1)
	h := router.AddConsumerHandler(route.Name, route.Topic, pubsub, route.Handler)
	// Outermost: take the chain's answer and ack, so the in-memory Pub/Sub
	// does not redeliver what the test only wants to see once.
	h.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			_, err := next(m)
			select {
			case result <- err:
			default:
			}
			return nil, nil
		}
	})
	if cfg.Ledger != nil {
		guard, err := middleware.NewIdempotency(cfg.Ledger, nil)
		if err != nil {
			t.Fatalf("ferrytest: %v", err)
		}
		h.AddMiddleware(guard.Middleware)
	}
	h.AddMiddleware(route.Middleware...)
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	select {
	case <-router.Running():
	case <-ctx.Done():
		t.Fatalf("ferrytest: router did not start")
	}
	if err := pubsub.Publish(route.Topic, msg); err != nil {
		t.Fatalf("ferrytest: publishing: %v", err)
	}
	select {
	case err := <-result:
		return err
	case <-ctx.Done():
		t.Fatalf("ferrytest: route %s did not answer within %s", route.Name, cfg.Timeout)
		return nil
	}
}
