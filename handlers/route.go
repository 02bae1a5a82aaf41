package handlers

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Route is one consumer handler. The application's route table, a []Route,
// is its contents page: every handler, its topic, whether it needs order,
// and its own middleware.
type Route struct {
	// Name identifies the handler: its queue and its ledger key. Stable.
	Name string
	// Topic is the event topic the handler consumes.
	Topic string
	// Ordered marks handlers that need events of one aggregate in outbox
	// order (a charge and its refund): the relay sends an aggregate's
	// events of the topic one after another (a failing head holds the
	// rest back), and the topic's queues are partitioned by aggregate
	// (FERRY_AMQP_PARTITIONS), each with a single active consumer. A batch
	// route cannot be ordered.
	Ordered bool
	// Handler processes one message. Return nil only when its effect is done.
	// A route has a Handler or a Batch, not both.
	Handler message.NoPublishHandlerFunc
	// Batch, instead of Handler, handles the route's messages many at a
	// time, in one transaction per batch: for handlers whose effects are
	// database writes (projections, read models), where the per-message
	// transaction is most of the cost. Not for ordered routes.
	Batch *Batch
	// Middleware wraps only this handler, inside the router-wide chain
	// (inside the idempotency transaction).
	Middleware []message.HandlerMiddleware
}

var validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$`)

// Validate reports every problem of r at once.
func (r Route) Validate() error {
	var errs []error
	if !validName.MatchString(r.Name) {
		errs = append(errs, fmt.Errorf("route name %q must match %s", r.Name, validName))
	}
	if err := pipeline.ValidateTopicName(r.Topic); err != nil {
		errs = append(errs, fmt.Errorf("route %q: %w", r.Name, err))
	}
	switch {
	case r.Handler == nil && r.Batch == nil:
		errs = append(errs, fmt.Errorf("route %q has no handler", r.Name))
	case r.Handler != nil && r.Batch != nil:
		errs = append(errs, fmt.Errorf("route %q has both a Handler and a Batch; it takes one", r.Name))
	case r.Batch != nil && r.Batch.Handler == nil:
		errs = append(errs, fmt.Errorf("route %q: its Batch has no Handler", r.Name))
	}
	if r.Batch != nil && r.Ordered {
		errs = append(errs, fmt.Errorf("route %q is ordered and batched: a batch keeps no order, so an ordered route takes a Handler", r.Name))
	}
	return errors.Join(errs...)
}

// Batch is a route's batch handler and its batching (see Route.Batch).
//
// Each message is still settled alone: its ledger row, its ack, its
// retries and its poisoning are its own. The batch handler runs in the
// ledger's transaction (pgledger.TxFromContext(ctx)) with the messages not
// processed before; if it fails, or the batch's transaction does, every
// message of the batch is tried again alone (the handler called with that
// one message), so only the message at fault is retried and poisoned. An
// effect outside the transaction (a call to a provider) may then run
// twice, as on any redelivery: pass the message id as its idempotency key.
//
// The route's Middleware wraps each message before it joins a batch,
// outside the batch's transaction.
type Batch struct {
	// Handler handles one batch. Return nil only when every message's
	// effect is done; the messages keep their own contexts (trace, logger).
	Handler func(ctx context.Context, msgs []*message.Message) error
	// MaxSize is the most messages in one batch; the route's consumer (one
	// per process, whatever FERRY_AMQP_CONSUMERS says) holds twice as many
	// deliveries. Default 100, at most 10,000.
	MaxSize int
	// MaxWait is how long a batch waits to fill after its first message:
	// the latency a message may gain when the queue is nearly idle.
	// Default 5ms, at most 1s.
	MaxWait time.Duration
	// MaxGap closes a batch before MaxWait when no message joined it for
	// this long: at a steady low rate, waiting for messages that are not
	// coming only adds latency; during a drain they join microseconds
	// apart and batches still fill. Default 1ms; negative: off.
	MaxGap time.Duration
}

// ValidateRoutes checks every route and that names are unique.
func ValidateRoutes(routes []Route) error {
	var errs []error
	seen := make(map[string]bool, len(routes))
	for _, r := range routes {
		if err := r.Validate(); err != nil {
			errs = append(errs, err)
		}
		if seen[r.Name] {
			errs = append(errs, fmt.Errorf("route name %q is used twice", r.Name))
		}
		seen[r.Name] = true
	}
	return errors.Join(errs...)
}
