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

// Reachability is implemented by publishers that know, without asking the
// broker, whether a publish can get through now (rabbit.BatchPublisher):
// the relay asks it before it takes rows after an outage, so a relay whose
// own link is down or silent holds nothing (the position, a claim) that the
// relays which can publish need.
type Reachability interface {
	// Reachable returns nil when a publish may get through, else why not
	// (an error marked Infrastructure). It does not block.
	Reachable() error
}

// Ordering is implemented by publishers whose topology keeps some topics in
// per-aggregate order (rabbit.BatchPublisher). The relay takes its ordered
// topics from its publisher, so relay and broker topology cannot disagree.
type Ordering interface {
	// OrderedTopics returns the sorted ordered topics.
	OrderedTopics() []string
}
