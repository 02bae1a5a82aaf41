package middleware

import (
	"errors"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults of InfrastructureConfig.
const (
	DefaultInfrastructureInitial = time.Second
	DefaultInfrastructureMax     = 30 * time.Second
)

// InfrastructureConfig configures the link that waits out failures of
// Ferry's own infrastructure.
type InfrastructureConfig struct {
	// Initial is the first wait after such a failure. Default 1s.
	Initial time.Duration
	// Max caps the wait, which doubles after each failure. Default 30s.
	Max time.Duration
	// Recorder, if set, is told of every attempt retried this way.
	Recorder Recorder
}

// Middleware returns the link that waits out infrastructure failures
// (errors marked pipeline.Infrastructure: the ledger's database unreachable,
// a connection reset, a serialization failure). Such a failure is not the
// message's: the attempt is tried again, in process, after a growing pause,
// for as long as it takes, without counting an attempt and without reaching
// the durable retry or the poison store outside. The delivery stays
// unacked meanwhile; a consumer stopped while waiting nacks it, and it is
// delivered again. Each wait is logged at WARN and counted
// (OutcomeInfrastructureRetry).
//
// RabbitMQ closes a channel whose delivery stays unacked past its
// consumer_timeout (30 min by default); the message is then redelivered,
// still with its attempts unspent.
func (c InfrastructureConfig) Middleware(logger *slog.Logger) (message.HandlerMiddleware, error) {
	b := pipeline.Backoff{Initial: c.Initial, Max: c.Max, Multiplier: 2, Jitter: 0.2}
	if b.Initial == 0 {
		b.Initial = DefaultInfrastructureInitial
	}
	if b.Max == 0 {
		b.Max = DefaultInfrastructureMax
	}
	if err := b.Validate(); err != nil {
		return nil, errors.New("middleware: InfrastructureConfig: " + err.Error())
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			for n := 1; ; n++ {
				produced, err := h(msg)
				if err == nil || !pipeline.IsInfrastructure(err) {
					return produced, err
				}
				if ctx.Err() != nil {
					return nil, ctx.Err() // stopping: nacked, delivered again
				}
				handler := message.HandlerNameFromCtx(ctx)
				delay := b.Delay(n)
				recorderOr(c.Recorder).Record(pipeline.RouteName(handler), OutcomeInfrastructureRetry)
				logger.WarnContext(ctx, "infrastructure unavailable; waiting before trying again (the message's attempts are not spent)",
					"handler", handler, "wait", delay, "infrastructure_failures", n, "error", err)
				if err := pipeline.Sleep(ctx, delay); err != nil {
					return nil, err // stopping: back to the broker, first in line
				}
			}
		}
	}, nil
}
