package agenttools

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Emitter writes a tool's intents into the outbox, inside the call's
// transaction: they are relayed if and only if the call commits. It is the
// only way a tool body reaches the world. The intents are built and checked
// when emitted, and written with the call's COMMIT, in its round trip.
type Emitter struct {
	pending  *pgoutbox.Pending
	readOnly bool
	ids      []string
}

// IntentOption adjusts one intent.
type IntentOption func(*message.Message) error

// After delays the intent: it is relayed no sooner than d after the commit
// (the article's "welcome mail in 3 minutes"), from the same table.
func After(d time.Duration) IntentOption {
	return func(m *message.Message) error {
		if d < 0 {
			return errors.New("tools: After needs a non-negative delay")
		}
		pipeline.WithDelay(m, d)
		return nil
	}
}

// At schedules the intent for t.
func At(t time.Time) IntentOption {
	return func(m *message.Message) error {
		pipeline.WithDeliverAt(m, t)
		return nil
	}
}

// ErrReadOnly is returned by a read-only tool's Emitter.
var ErrReadOnly = errors.New("tools: a read-only tool cannot emit intents")

// Emit writes an intent on topic for aggregateID with payload (encoded as
// JSON, with the correlation and trace ids of ctx) and returns its message
// id, which consumers see and use as their idempotency key.
func (e *Emitter) Emit(ctx context.Context, topic, aggregateID string, payload any, opts ...IntentOption) (string, error) {
	msg, err := pipeline.NewEvent(ctx, aggregateID, payload)
	if err != nil {
		return "", err
	}
	return e.EmitMessage(ctx, topic, msg, opts...)
}

// EmitMessage writes msg (a Watermill message, payload and metadata as
// they are) as an intent on topic.
func (e *Emitter) EmitMessage(ctx context.Context, topic string, msg *message.Message, opts ...IntentOption) (string, error) {
	if e == nil || e.readOnly {
		return "", ErrReadOnly
	}
	for _, o := range opts {
		if err := o(msg); err != nil {
			return "", err
		}
	}
	if err := e.pending.PublishEvents(ctx, pipeline.Outgoing{Topic: topic, Msg: msg}); err != nil {
		return "", fmt.Errorf("writing intent %s: %w", topic, err)
	}
	e.ids = append(e.ids, msg.UUID)
	return msg.UUID, nil
}
