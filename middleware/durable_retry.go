package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults of DurableRetryConfig.
const (
	// DefaultDurableRetryMaxAttempts counts every delivery, the first included.
	DefaultDurableRetryMaxAttempts = 5
	maxLastErrorLength             = 1024
	maxHistoryErrorLength          = 300
)

// RetryScheduler stores a message for delivery after a delay, durably
// (pgoutbox.Rescheduler writes it into the outbox).
type RetryScheduler interface {
	ScheduleRetry(ctx context.Context, r pipeline.Retry) error
}

// DurableRetryConfig configures durable delayed retries.
type DurableRetryConfig struct {
	// Scheduler stores retries. Required.
	Scheduler RetryScheduler
	// MaxAttempts is how many deliveries a message gets, the first
	// included, before it is poisoned. Default 5.
	MaxAttempts int
	// Backoff is the schedule between deliveries. Default 30s doubling,
	// capped at 15m, with 20% jitter.
	Backoff pipeline.Backoff
	// Recorder, if set, is told of every retry scheduled and deferral.
	Recorder Recorder
	// Holds, if set, is told when an ordered partition is held behind a
	// failing head and when it is released, so that the wait is visible
	// outside the process (pgheld.Store records it).
	Holds PartitionHolds
}

// PartitionHolds records the ordered partitions held behind a failing
// head message. Its errors are logged, never fail a delivery.
type PartitionHolds interface {
	// Held records the hold of messageID, since when (the first failure
	// of this outage) and when it is tried next.
	Held(ctx context.Context, consumer, messageID string, attempt int, since, retryAt time.Time, lastError string) error
	Released(ctx context.Context, consumer string) error
}

// PartitionResumer, implemented by a PartitionHolds, gives the head
// message of a held partition, delivered again after its consumer stopped
// (a deploy, a crash), the attempt its hold had reached, since when it
// holds and when it was to be tried next: a stop never resets a failing
// head's attempts, nor spends one before its backoff is out. Without it, a
// partition whose consumers restart more often than MaxAttempts would
// retry a broken head (and call its provider) forever.
type PartitionResumer interface {
	HeldAttempt(ctx context.Context, consumer, messageID string) (attempt int, since, retryAt time.Time, ok bool, err error)
}

// PartitionHeadKeeper, implemented by a PartitionHolds, keeps the held
// head's payload and headers (once, at its first failure), for the page
// an operator reads it on.
type PartitionHeadKeeper interface {
	KeepHead(ctx context.Context, consumer, messageID string, payload []byte, headers map[string]string) error
}

// PartitionRetrier, implemented by a PartitionHolds, says whether an
// operator asked to try the held head again now, taking the request: the
// hold looks every RetryNowPoll while it waits out its backoff.
type PartitionRetrier interface {
	RetryRequested(ctx context.Context, consumer, messageID string) (bool, error)
}

// RetryNowPoll is how often a held partition looks for an operator's
// "retry now" while it waits.
const RetryNowPoll = time.Second

// transient are metadata keys that describe one delivery, not the message.
var transient = []string{
	"x-delivery-count", pipeline.MetaOutboxAttempt, pipeline.MetaOutboxCreatedAt, pipeline.MetaAggregateID,
	pipeline.MetaPoisonedAt, pipeline.MetaPoisonPermanent, pipeline.MetaPoisonedConsumer,
}

// Middleware returns the durable retry link. When the quick in-process
// retries inside it are exhausted, it writes the message back, through the
// scheduler, to be delivered again to this handler's queue only after the
// next Backoff delay, and acks the delivery: the wait survives a consumer
// restart and blocks nobody. A partition of an ordered topic holds instead
// (see holdPartition): there, order outranks throughput. The attempt count travels with the message
// (pipeline.MetaAttempt). Permanent errors, the last attempt, and a
// scheduling failure pass through to the poison link outside, with the
// failure times recorded on the message. A deferral (pipeline.Defer) is
// rescheduled after its own delay and does not count as an attempt.
func (c DurableRetryConfig) Middleware(logger *slog.Logger) (message.HandlerMiddleware, error) {
	if c.Scheduler == nil {
		return nil, errors.New("middleware: DurableRetryConfig.Scheduler is required")
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultDurableRetryMaxAttempts
	}
	if c.MaxAttempts < 1 {
		return nil, errors.New("middleware: DurableRetryConfig.MaxAttempts must be at least 1")
	}
	c.Backoff = c.Backoff.WithDefaults()
	if err := c.Backoff.Validate(); err != nil {
		return nil, fmt.Errorf("DurableRetryConfig.%w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if pipeline.IsPartition(message.HandlerNameFromCtx(msg.Context())) {
				return c.holdPartition(h, msg, logger)
			}
			produced, err := h(msg)
			if err == nil || errors.Is(err, context.Canceled) {
				return produced, err
			}
			attempt, delay, deferred, giveUp := c.nextTry(msg, pipeline.DeliveryAttempt(msg), err)
			if giveUp != nil {
				return nil, giveUp
			}
			ctx := msg.Context()
			handler := message.HandlerNameFromCtx(ctx)
			headers := make(map[string]string, len(msg.Metadata)+4)
			for k, v := range msg.Metadata {
				if !slices.Contains(transient, k) {
					headers[k] = v
				}
			}
			headers[pipeline.MetaMessageID] = pipeline.MessageID(msg)
			headers[pipeline.MetaAttempt] = strconv.Itoa(attempt)
			headers[pipeline.MetaOriginalTopic] = pipeline.OriginalTopic(msg, message.SubscribeTopicFromCtx(ctx))
			headers[pipeline.MetaRetryQueue] = pipeline.ConsumerQueue(handler)
			// The aggregate as delivered, even empty: it is part of the
			// message's content (pipeline.ContentDigest), and the retry
			// topic is not ordered.
			aggregate := msg.Metadata.Get(pipeline.MetaAggregateID)
			// Scheduling is not part of the handler's work: a deadline or
			// cancellation of the delivery must not lose the retry.
			if serr := c.schedule(ctx, pipeline.Retry{
				AggregateID: aggregate, Payload: msg.Payload, Headers: headers, Delay: delay,
			}, logger); serr != nil {
				return nil, errors.Join(err, fmt.Errorf("scheduling durable retry: %w", serr))
			}
			c.recordRetry(handler, deferred)
			logger.WarnContext(ctx, "handler failed; durable retry scheduled",
				"handler", handler, "next_attempt", attempt, "retry_in", delay.String(), "deferred", deferred, "error", pipeline.ErrorText(err, maxLastErrorLength))
			return nil, nil
		}
	}, nil
}

// schedule stores r. While the store's infrastructure is down (the
// outbox's database), it waits and tries again rather than let a healthy
// message fall through to the poison link; a stop of the consumer ends the
// wait, and the delivery is nacked and comes back.
func (c DurableRetryConfig) schedule(ctx context.Context, r pipeline.Retry, logger *slog.Logger) error {
	wait := pipeline.Backoff{Initial: DefaultInfrastructureInitial, Max: DefaultInfrastructureMax, Multiplier: 2, Jitter: 0.2}
	for n := 1; ; n++ {
		// Scheduling is not part of the handler's work: a deadline of the
		// delivery must not lose the retry.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		err := c.Scheduler.ScheduleRetry(sctx, r)
		cancel()
		if err == nil || !pipeline.IsInfrastructure(err) {
			return err
		}
		d := wait.Delay(n)
		logger.WarnContext(ctx, "cannot store the durable retry: infrastructure unavailable; waiting", "wait", d, "error", err)
		if serr := pipeline.Sleep(ctx, d); serr != nil {
			return pipeline.Infrastructure(errors.Join(serr, err))
		}
	}
}

// holdPartition is the retry of an ordered topic's message: rescheduling
// it would let the later events of its aggregate overtake it, so the
// partition waits instead, in process, through the same backoff and
// attempts, and poisons only after the last. The delivery stays unacked
// while it waits: a consumer that dies meanwhile hands the message, still
// first in line, to the next one, which goes on from the attempt the hold
// had reached when Holds is a PartitionResumer (pgheld.Store is).
// Keep the total wait under RabbitMQ's consumer_timeout (30 min by default).
func (c DurableRetryConfig) holdPartition(h message.HandlerFunc, msg *message.Message, logger *slog.Logger) ([]*message.Message, error) {
	ctx := msg.Context()
	handler := message.HandlerNameFromCtx(ctx)
	attempt := pipeline.DeliveryAttempt(msg)
	var since time.Time
	record := func(f func(context.Context) error) {
		if c.Holds == nil {
			return
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := f(rctx); err != nil {
			logger.WarnContext(ctx, "cannot record the partition's hold", "handler", handler, "error", pipeline.ErrorText(err, 300))
		}
	}
	var resumeAt time.Time
	if r, ok := c.Holds.(PartitionResumer); ok {
		// This head was held before its consumer stopped: its attempts
		// go on from where they were, after the backoff it was in.
		record(func(rctx context.Context) error {
			held, heldSince, retryAt, found, err := r.HeldAttempt(rctx, handler, pipeline.MessageID(msg))
			if found && held > attempt {
				attempt, since, resumeAt = held, heldSince, retryAt
				msg.Metadata.Set(pipeline.MetaAttempt, strconv.Itoa(attempt))
			}
			return err
		})
	}
	stopped := false
	defer func() {
		// A stop keeps the hold (and its attempt) for the consumer that
		// gets the head next; an outcome ends it.
		if !since.IsZero() && !stopped {
			record(func(rctx context.Context) error { return c.Holds.Released(rctx, handler) })
		}
	}()
	if wait := time.Until(resumeAt); wait > 0 {
		logger.InfoContext(ctx, "resuming a held head after its backoff", "handler", handler, "next_attempt", attempt, "retry_in", wait.Round(time.Millisecond).String())
		if err := c.waitOrRetryNow(ctx, handler, pipeline.MessageID(msg), wait, logger); err != nil {
			stopped = true
			return nil, err
		}
	}
	for {
		produced, err := h(msg)
		if errors.Is(err, context.Canceled) {
			stopped = true
			return produced, err
		}
		if err == nil {
			return produced, err
		}
		next, delay, deferred, giveUp := c.nextTry(msg, attempt, err)
		if giveUp != nil {
			return nil, giveUp
		}
		attempt = next
		msg.Metadata.Set(pipeline.MetaAttempt, strconv.Itoa(attempt))
		first := since.IsZero()
		if first {
			since = time.Now()
		}
		record(func(rctx context.Context) error {
			return c.Holds.Held(rctx, handler, pipeline.MessageID(msg), attempt, since, time.Now().Add(delay), pipeline.ErrorText(err, maxLastErrorLength))
		})
		if k, ok := c.Holds.(PartitionHeadKeeper); ok && first {
			record(func(rctx context.Context) error {
				return k.KeepHead(rctx, handler, pipeline.MessageID(msg), msg.Payload, map[string]string(msg.Metadata))
			})
		}
		c.recordRetry(handler, deferred)
		logger.WarnContext(ctx, "handler of an ordered topic failed; holding the partition until the retry",
			"handler", handler, "next_attempt", attempt, "retry_in", delay.String(), "deferred", deferred, "error", pipeline.ErrorText(err, maxLastErrorLength))
		// A stop ends the wait, never a nack-requeue: the consumer gives
		// the delivery back with its channel, first in line (rabbit.Consumer).
		if err := c.waitOrRetryNow(ctx, handler, pipeline.MessageID(msg), delay, logger); err != nil {
			stopped = true
			return nil, err
		}
	}
}

// waitOrRetryNow sleeps delay, or less when an operator asks to retry the
// held head now (PartitionRetrier). It fails only when ctx ends.
func (c DurableRetryConfig) waitOrRetryNow(ctx context.Context, handler, messageID string, delay time.Duration, logger *slog.Logger) error {
	r, ok := c.Holds.(PartitionRetrier)
	if !ok {
		return pipeline.Sleep(ctx, delay)
	}
	deadline := time.Now().Add(delay)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return nil
		}
		if err := pipeline.Sleep(ctx, min(left, RetryNowPoll)); err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		now, err := r.RetryRequested(rctx, handler, messageID)
		cancel()
		if err != nil && ctx.Err() == nil {
			// The hold goes on with its backoff; the request stays for the next look.
			logger.WarnContext(ctx, "cannot look for a retry-now request", "handler", handler, "error", pipeline.ErrorText(err, 300))
		}
		if now {
			logger.InfoContext(ctx, "an operator asked to retry the held head now", "handler", handler, "message_id", messageID)
			return nil
		}
	}
}

// nextTry decides what follows a failed attempt: a deferral keeps the
// attempt and takes its own delay; a failure records its times and error
// on msg and takes the next backoff delay, unless it is permanent or the
// last attempt, when giveUp is the error for the poison link.
func (c DurableRetryConfig) nextTry(msg *message.Message, attempt int, err error) (next int, delay time.Duration, deferred bool, giveUp error) {
	if delay, deferred = pipeline.Deferred(err); deferred {
		return attempt, delay, true, nil
	}
	now := time.Now().UTC().Format(time.RFC3339Nano)
	if msg.Metadata.Get(pipeline.MetaFirstFailedAt) == "" {
		msg.Metadata.Set(pipeline.MetaFirstFailedAt, now)
	}
	msg.Metadata.Set(pipeline.MetaLastFailedAt, now)
	msg.Metadata.Set(pipeline.MetaLastError, pipeline.ErrorText(err, maxLastErrorLength))
	pipeline.AppendErrorHistory(msg, pipeline.FailedAttempt{Attempt: attempt, At: now, Error: pipeline.ErrorText(err, maxHistoryErrorLength)})
	switch {
	case pipeline.IsPermanent(err):
		return attempt, 0, false, err
	case attempt >= c.MaxAttempts:
		return attempt, 0, false, fmt.Errorf("gave up after %d attempts: %w", attempt, err)
	}
	return attempt + 1, c.Backoff.Delay(attempt), false, nil
}

func (c DurableRetryConfig) recordRetry(handler string, deferred bool) {
	outcome := OutcomeRetryScheduled
	if deferred {
		outcome = OutcomeDeferred
	}
	recorderOr(c.Recorder).Record(pipeline.RouteName(handler), outcome)
}
