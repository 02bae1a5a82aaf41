package handlers

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/evolve"
)

// Evolving is Typed for an event type with versions: an event of any
// version chain reads (older ones upcast step by step, newer ones
// downcast where the chain has Down steps) reaches fn as the current type
// T, whether it comes from the broker, a durable retry or a poison
// requeue, since all of them arrive here. An event the chain cannot bring
// to T (a version it does not reach, a step's error, a payload its
// version's type refuses, T's Validate) is refused with a
// pipeline.Permanent error naming the event type, the version and the
// step: poisoned with that reason, and requeued once a chain that reads
// it is deployed. A batch route decodes with chain.DecodeMessage.
func Evolving[T any](chain *evolve.Chain[T], fn func(ctx context.Context, event *T) error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		event, err := chain.DecodeMessage(msg)
		if err != nil {
			return err
		}
		return fn(ContextWithMessage(msg.Context(), msg), event)
	}
}
