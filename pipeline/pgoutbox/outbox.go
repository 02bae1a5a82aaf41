package pgoutbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Outbox publishes events into the outbox table inside a caller's transaction.
// It is safe for concurrent use.
type Outbox struct {
	adapter SchemaAdapter
	logger  watermill.LoggerAdapter
}

// New returns an Outbox writing through adapter. A nil logger discards logs.
func New(adapter SchemaAdapter, logger *slog.Logger) *Outbox {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Outbox{adapter: adapter, logger: watermill.NewSlogLogger(logger)}
}

// PublishTx writes msgs for topic into the outbox as part of tx. Nothing is
// visible to the relay until tx commits, and nothing remains if it rolls
// back: that is the whole contract of an outbox.
//
// The write goes through Watermill's SQL publisher bound to tx, so any
// Watermill publisher decorator works here too. tx must come from a
// database/sql handle over pgx (stdlib.OpenDBFromPool).
func (o *Outbox) PublishTx(ctx context.Context, tx *sql.Tx, topic string, msgs ...*message.Message) error {
	if tx == nil {
		return errors.New("pgoutbox: PublishTx needs a transaction")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("publishing to outbox: %w", err)
	}
	// A publisher per call is cheap (no I/O) and binds Watermill's publisher
	// to this one transaction; AutoInitializeSchema stays off, as it must
	// inside a transaction.
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: o.adapter}, o.logger)
	if err != nil {
		return fmt.Errorf("creating outbox publisher: %w", err)
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		return fmt.Errorf("publishing %d event(s) to outbox topic %q: %w", len(msgs), topic, err)
	}
	return nil
}

// PublishEventsTx writes events of any topics into the outbox as part of
// tx, in one statement: one round trip for all the events of a business
// transaction, however many topics they have.
func (o *Outbox) PublishEventsTx(ctx context.Context, tx *sql.Tx, events ...pipeline.Outgoing) error {
	if len(events) == 0 {
		return nil
	}
	msgs := make([]*message.Message, len(events))
	for i, e := range events {
		if e.Msg == nil {
			return fmt.Errorf("pgoutbox: event %d has no message", i)
		}
		if err := validateTopic(e.Topic); err != nil {
			return fmt.Errorf("event %d (%s): %w", i, e.Msg.UUID, err)
		}
		e.Msg.Metadata.Set(pipeline.MetaTopic, e.Topic)
		msgs[i] = e.Msg
	}
	return o.PublishTx(ctx, tx, events[0].Topic, msgs...)
}
