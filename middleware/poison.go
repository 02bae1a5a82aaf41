package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/ferry-dev/ferry/pipeline"
)

// DefaultPoisonTopic is the topic the poison middleware publishes to; with
// Ferry's store (pgpoison) it names the table.
const DefaultPoisonTopic = "poison_messages"

// PoisonConfig configures the poison queue.
type PoisonConfig struct {
	// Publisher stores poisoned messages durably before Publish returns
	// (pgpoison.NewPublisher does), since the message is then acked. Required.
	Publisher message.Publisher
	// Topic is the poison queue's topic. Default "poison_messages".
	Topic string
	// Recorder, if set, is told of every poisoned message.
	Recorder Recorder
	// StoreRetryInitial is the first pause after the poison store refused
	// a message; it doubles up to StoreRetryMax. Defaults 1s and 30s.
	StoreRetryInitial time.Duration
	StoreRetryMax     time.Duration
}

// Middleware returns the poison queue middleware (Watermill's PoisonQueue),
// which publishes a message whose handler still fails to the poison topic,
// with the reason, original topic and handler, and then acks it. It is
// never acked as done without being somewhere: while the poison store
// cannot take it (its database down), the store is tried again with a
// growing pause (StoreRetryInitial doubling to StoreRetryMax), without running the handler again,
// each failure counted (OutcomePoisonStoreFailed) and logged at most once
// per PoisonStoreLogInterval; a stop of the consumer nacks it, and it comes
// back to the next one. A nack straight away would hot-loop the message
// (and its handler's effect) and hold its ordered partition.
//
// A handler stopped by shutdown (context.Canceled) is not poisoned: the
// message is nacked and comes back to the next consumer.
func (c PoisonConfig) Middleware(logger *slog.Logger) (message.HandlerMiddleware, error) {
	if c.Publisher == nil {
		return nil, errors.New("middleware: PoisonConfig.Publisher is required")
	}
	if c.Topic == "" {
		c.Topic = DefaultPoisonTopic
	}
	// Neither a shutdown nor a failure of Ferry's own infrastructure is
	// the message's fault: it is nacked and delivered again.
	poisonable := func(err error) bool {
		return !errors.Is(err, context.Canceled) && !pipeline.IsInfrastructure(err)
	}
	wait := pipeline.Backoff{
		Initial: cmp.Or(c.StoreRetryInitial, DefaultInfrastructureInitial), Max: cmp.Or(c.StoreRetryMax, DefaultInfrastructureMax),
		Multiplier: 2, Jitter: 0.2,
	}
	if err := wait.Validate(); err != nil {
		return nil, fmt.Errorf("middleware: PoisonConfig.StoreRetry: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	store := &patientPublisher{Publisher: routeNamingPublisher{c.Publisher}, logger: logger, recorder: recorderOr(c.Recorder), wait: wait}
	pq, err := wmw.PoisonQueueWithFilter(store, c.Topic, poisonable)
	if err != nil {
		return nil, err
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			var handlerErr error
			poisoned := pq(func(msg *message.Message) ([]*message.Message, error) {
				produced, err := h(msg)
				handlerErr = err
				if err != nil && poisonable(err) {
					now := time.Now().UTC().Format(time.RFC3339Nano)
					msg.Metadata.Set(pipeline.MetaPoisonedAt, now)
					msg.Metadata.Set(pipeline.MetaPoisonPermanent, boolText(pipeline.IsPermanent(err)))
					if msg.Metadata.Get(pipeline.MetaFirstFailedAt) == "" {
						msg.Metadata.Set(pipeline.MetaFirstFailedAt, now)
					}
					if msg.Metadata.Get(pipeline.MetaLastFailedAt) == "" {
						msg.Metadata.Set(pipeline.MetaLastFailedAt, now)
					}
				}
				return produced, err
			})
			produced, err := poisoned(msg)
			if handlerErr != nil && err == nil && poisonable(handlerErr) {
				route := pipeline.RouteName(message.HandlerNameFromCtx(msg.Context()))
				recorderOr(c.Recorder).Record(route, OutcomePoisoned)
				if cr, ok := c.Recorder.(CauseRecorder); ok {
					cr.RecordPoisonCause(route, pipeline.ReasonGroup(handlerErr))
				}
				logger.WarnContext(msg.Context(), "message moved to the poison store",
					"handler", message.HandlerNameFromCtx(msg.Context()), "final_attempt", pipeline.DeliveryAttempt(msg),
					"reason", pipeline.ErrorText(handlerErr, maxReasonInLog))
			}
			return produced, err
		}
	}, nil
}

// routeNamingPublisher records the route's name as the poisoned handler
// (the name operators know and requeue to), keeping the exact consumer apart.
type routeNamingPublisher struct{ message.Publisher }

func (p routeNamingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if h := m.Metadata.Get(wmw.PoisonedHandlerKey); h != "" {
			m.Metadata.Set(pipeline.MetaPoisonedConsumer, h)
			m.Metadata.Set(wmw.PoisonedHandlerKey, pipeline.RouteName(h))
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

func boolText(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

// maxReasonInLog bounds a reason in a log line.
const maxReasonInLog = 1024

// PoisonStoreLogInterval is how often, at most, a consumer logs that its
// poison store refuses messages; every refusal is counted all the same.
const PoisonStoreLogInterval = 30 * time.Second

// patientPublisher stores poisoned messages, waiting out a store that
// cannot take them instead of failing the delivery at once.
type patientPublisher struct {
	message.Publisher
	logger   *slog.Logger
	recorder Recorder
	wait     pipeline.Backoff
	// lastLog is when a refusal was last logged (Unix nanoseconds), shared
	// by every message of the process.
	lastLog atomic.Int64
}

func (p *patientPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	for n := 1; ; n++ {
		err := p.Publisher.Publish(topic, msgs...)
		if err == nil {
			if n > 1 {
				p.logger.InfoContext(ctx, "poison store took the message after it had refused it", "refusals", n-1)
			}
			return nil
		}
		handler := message.HandlerNameFromCtx(ctx)
		p.recorder.Record(pipeline.RouteName(handler), OutcomePoisonStoreFailed)
		delay := p.wait.Delay(n)
		now := time.Now().UnixNano()
		if last := p.lastLog.Load(); now-last >= int64(PoisonStoreLogInterval) && p.lastLog.CompareAndSwap(last, now) {
			p.logger.ErrorContext(ctx, "poison store refuses a message; holding it and trying again (logged once per interval, every refusal counted)",
				"handler", handler, "refusals", n, "wait", delay, "interval", PoisonStoreLogInterval,
				"error", pipeline.ErrorText(err, 1024))
		}
		if serr := pipeline.Sleep(ctx, delay); serr != nil {
			return fmt.Errorf("storing poisoned message: %w (stopped: %w)", err, serr)
		}
	}
}
