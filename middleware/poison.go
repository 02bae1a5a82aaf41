package middleware

import (
	"context"
	"errors"
	"log/slog"
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
}

// Middleware returns the poison queue middleware (Watermill's PoisonQueue),
// which publishes a message whose handler still fails to the poison topic,
// with the reason, original topic and handler, and then acks it. If that
// publish fails the error stands and the message is nacked: it is never
// acked as done without being somewhere.
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
	pq, err := wmw.PoisonQueueWithFilter(routeNamingPublisher{c.Publisher}, c.Topic, poisonable)
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
				recorderOr(c.Recorder).Record(pipeline.RouteName(message.HandlerNameFromCtx(msg.Context())), OutcomePoisoned)
				logger.WarnContext(msg.Context(), "message moved to the poison store",
					"handler", message.HandlerNameFromCtx(msg.Context()), "final_attempt", pipeline.DeliveryAttempt(msg),
					"reason", handlerErr.Error())
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
