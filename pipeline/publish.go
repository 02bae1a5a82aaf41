package pipeline

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Outgoing is one message of a batch, with its topic.
type Outgoing struct {
	Topic string
	Msg   *message.Message
}

// BatchPublisher is a publisher that can send a batch in one go and say
// which of its messages the broker confirmed: one error per message, nil
// for each confirmed. The relay uses it when its publisher has it, and
// publishes message by message otherwise.
type BatchPublisher interface {
	PublishBatch(ctx context.Context, batch []Outgoing) []error
}
