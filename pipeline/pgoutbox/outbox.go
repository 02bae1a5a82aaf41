package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/internal/republish"
)

// Outbox publishes events into the outbox table inside a caller's transaction.
// It is safe for concurrent use.
type Outbox struct {
	adapter schemaAdapter
	logger  watermill.LoggerAdapter
	waker   atomic.Pointer[Waker]
}

// SetWaker makes the outbox wake the relays after each commit of events
// it knows of: InTx's, and PublishTx's in a context that carries
// pipeline.WithAfterCommit (the consumers' ledger transactions do). Other
// commits are found by the relays' probes and polls.
func (o *Outbox) SetWaker(w *Waker) { o.waker.Store(w) }

// Committed wakes the relays (SetWaker): call it after committing a
// transaction you published into with PublishTx, when its context did not
// carry pipeline.WithAfterCommit. Without either, an idle relay finds the
// events at its next probe (FERRY_RELAY_PROBE_INTERVAL, 10 ms by default),
// or at its next poll (FERRY_RELAY_POLL_INTERVAL) with probing off.
func (o *Outbox) Committed() {
	if w := o.waker.Load(); w != nil {
		w.Committed()
	}
}

// New returns an Outbox configured by cfg. A nil logger discards logs.
func New(cfg Config, logger *slog.Logger) (*Outbox, error) {
	adapter := schemaAdapter{Config: cfg, quoted: cfg.Table.Quoted()}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Outbox{adapter: adapter, logger: watermill.NewSlogLogger(logger)}, nil
}

// Table is the outbox table the Outbox writes.
func (o *Outbox) Table() Table { return o.adapter.Table }

// Publish writes one event on topic inside tx, the pgx transaction of the
// business write (or a handler's ledger transaction,
// pgledger.TxFromContext): pipeline.NewEvent(ctx, aggregateID, payload)
// and PublishTx in one call, the shape most services need. It refuses what
// they refuse.
func (o *Outbox) Publish(ctx context.Context, tx pgx.Tx, topic, aggregateID string, payload any) error {
	if tx == nil {
		return errors.New("pgoutbox: Publish needs a transaction")
	}
	evt, err := pipeline.NewEvent(ctx, aggregateID, payload)
	if err != nil {
		return err
	}
	return o.PublishTx(ctx, PgxTx(tx), topic, evt)
}

// PublishTx writes msgs for topic into the outbox as part of tx. Nothing is
// visible to the relay until tx commits, and nothing remains if it rolls
// back: that is the whole contract of an outbox.
//
// Every message is checked before anything is written, and an invalid one
// fails the call with an error wrapping pipeline.ErrInvalidEvent, leaving
// tx usable: no UUID, an aggregate id, topic or metadata text that is not
// valid UTF-8 or holds a NUL, a payload over MaxPayloadBytes, a topic in
// RabbitMQ's reserved "amq." namespace, or metadata that only Ferry may set
// (pipeline.ReservedMetadata: refused, never overwritten). A nil payload is
// stored as an empty one.
//
// tx is a database/sql transaction (*sql.Tx, over pgx's stdlib driver) or a
// pgx transaction wrapped with PgxTx: a handler's ledger transaction is one,
// so a follow-up event commits with the handler's ledger row. The write goes
// through Watermill's SQL publisher bound to tx, so any Watermill publisher
// decorator works here too. A *sql.DB works as well, but then each call is
// its own transaction and atomicity with the business write is gone.
func (o *Outbox) PublishTx(ctx context.Context, tx wsql.ContextExecutor, topic string, msgs ...*message.Message) error {
	if tx == nil {
		return errors.New("pgoutbox: PublishTx needs a transaction")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("publishing to outbox: %w", err)
	}
	adapter := o.adapter
	adapter.republish = republish.Is(ctx)
	pub, err := o.publisher(tx, adapter)
	if err != nil {
		return err
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		return fmt.Errorf("publishing %d event(s) to outbox topic %q: %w", len(msgs), topic, err)
	}
	if w := o.waker.Load(); w != nil {
		pipeline.AfterCommit(ctx, w, w.Committed)
	}
	return nil
}

// Publisher returns Watermill's SQL publisher writing to the outbox through
// db. Bound to a transaction it joins it; bound to a *sql.DB every Publish is
// a transaction of its own, which makes the outbox, the relay and a
// rabbit.Subscriber one Watermill Pub/Sub. Creating one costs no I/O.
func (o *Outbox) Publisher(db wsql.ContextExecutor) (message.Publisher, error) {
	return o.publisher(db, o.adapter)
}

func (o *Outbox) publisher(db wsql.ContextExecutor, adapter schemaAdapter) (message.Publisher, error) {
	// AutoInitializeSchema stays off, as it must inside a transaction:
	// migrations own the table.
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: adapter}, o.logger)
	if err != nil {
		return nil, fmt.Errorf("creating outbox publisher: %w", err)
	}
	return checkedPublisher{pub, adapter.republish}, nil
}

// checkedPublisher checks the topic before watermill-sql does, so that a
// bad one is refused as pipeline.ErrInvalidEvent with Ferry's reason.
type checkedPublisher struct {
	message.Publisher
	republish bool
}

func (p checkedPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := validateTopic(topic, p.republish); err != nil {
		return err
	}
	return p.Publisher.Publish(topic, msgs...)
}

// PublishEventsTx writes events of any topics into the outbox as part of
// tx, in one statement: one round trip for all the events of a business
// transaction, however many topics they have.
func (o *Outbox) PublishEventsTx(ctx context.Context, tx wsql.ContextExecutor, events ...pipeline.Outgoing) error {
	if len(events) == 0 {
		return nil
	}
	msgs := make([]*message.Message, len(events))
	for i, e := range events {
		if e.Msg == nil {
			return fmt.Errorf("pgoutbox: event %d has no message", i)
		}
		if err := validateTopic(e.Topic, republish.Is(ctx)); err != nil {
			return fmt.Errorf("event %d (%s): %w", i, e.Msg.UUID, err)
		}
		e.Msg.Metadata.Set(pipeline.MetaTopic, e.Topic)
		msgs[i] = e.Msg
	}
	return o.PublishTx(ctx, tx, events[0].Topic, msgs...)
}
