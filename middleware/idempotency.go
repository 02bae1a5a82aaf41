package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// maxMessageIDLength is the outbox's bound on a message UUID.
const maxMessageIDLength = 512

// Ledger is what the idempotency guard needs from a durable ledger
// (pgledger.Ledger is Ferry's). Once runs fn unless consumer has already
// processed messageID, with the check, fn and the record in one transaction.
type Ledger interface {
	// digest identifies the message's content (pipeline.ContentDigest: its
	// payload and content metadata): a processed id that comes back with
	// another digest (pipeline.SameContent false) must be reported as an
	// error wrapping pipeline.ErrIDConflict, not skipped.
	Once(ctx context.Context, consumer, messageID string, digest []byte, fn func(ctx context.Context) error) (ran bool, err error)
}

// Idempotency guards handlers with a Ledger, keyed by route name and
// message id (pipeline.MessageID: the publisher's message UUID, stable
// across redeliveries, durable retries and requeues).
type Idempotency struct {
	// Recorder, if set, is told of every handled and duplicate delivery.
	Recorder Recorder

	ledger     Ledger
	logger     *slog.Logger
	duplicates atomic.Int64
}

// NewIdempotency returns a guard over ledger.
func NewIdempotency(ledger Ledger, logger *slog.Logger) (*Idempotency, error) {
	if ledger == nil {
		return nil, errors.New("middleware: NewIdempotency needs a ledger")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Idempotency{ledger: ledger, logger: logger}, nil
}

// Duplicates returns how many deliveries were acked without running their
// handler because the ledger had them already.
func (i *Idempotency) Duplicates() int64 { return i.duplicates.Load() }

// Middleware runs the handler inside the ledger's transaction: the
// handler's context carries it (pgledger.TxFromContext) for the handler's
// own writes. A message without an id cannot be deduplicated and is
// refused as Permanent, so it goes to the poison queue with that reason.
func (i *Idempotency) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		consumer, id, err := ledgerKey(msg)
		if err != nil {
			return nil, err
		}
		outer := msg.Context()
		var produced []*message.Message
		ran, err := i.ledger.Once(outer, consumer, id, pipeline.ContentDigest(msg), func(ctx context.Context) error {
			msg.SetContext(ctx)
			defer msg.SetContext(outer)
			var err error
			produced, err = h(msg)
			return err
		})
		if err := i.settle(outer, consumer, ran, err); err != nil {
			return nil, err
		}
		return produced, nil
	}
}

// ledgerKey is the consumer (the route) and the message id a delivery is
// recorded under, or a Permanent error when it cannot be recorded.
func ledgerKey(msg *message.Message) (consumer, id string, err error) {
	id = pipeline.MessageID(msg)
	if id == "" {
		return "", "", pipeline.Permanent(errors.New("message has no id: it cannot be deduplicated"))
	}
	if !pipeline.ValidText(id) || len(id) > maxMessageIDLength {
		return "", "", pipeline.Permanent(fmt.Errorf("message id %q cannot be stored (invalid UTF-8, a NUL, or over %d bytes): it cannot be deduplicated",
			pipeline.CleanText(id, 100), maxMessageIDLength))
	}
	return pipeline.RouteName(message.HandlerNameFromCtx(msg.Context())), id, nil
}

// settle counts and logs what the ledger did with one delivery and returns
// the delivery's error: nil for handled and duplicate deliveries.
func (i *Idempotency) settle(ctx context.Context, consumer string, ran bool, err error) error {
	if errors.Is(err, pipeline.ErrIDConflict) {
		// Not a duplicate: someone published another message under an id
		// this handler has processed. Loud, counted, and kept with the
		// reason in the poison store; never acked as done.
		recorderOr(i.Recorder).Record(consumer, OutcomeIDConflict)
		i.logger.WarnContext(ctx, "message id reused with different content; not handled, poisoning",
			"handler", consumer, "error", err)
		return pipeline.Permanent(err)
	}
	if err != nil {
		return err
	}
	if ran {
		recorderOr(i.Recorder).Record(consumer, OutcomeHandled)
	} else {
		recorderOr(i.Recorder).Record(consumer, OutcomeDuplicate)
		i.duplicates.Add(1)
		i.logger.InfoContext(ctx, "duplicate delivery suppressed", "handler", consumer)
	}
	return nil
}
