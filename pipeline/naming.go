package pipeline

import (
	"context"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
)

// PartitionSeparator joins a route's name and a suffix in the name of a
// router handler: a partition ("payments.charge@3", also its queue's name)
// or one of several consumers of one queue ("notifications.mail@w2"). Route names cannot contain it, so the route a
// partition belongs to can always be recovered (RouteName): the ledger and
// idempotency keys use the route's name, so moving an aggregate to another
// partition never makes a processed message look new.
const PartitionSeparator = "@"

// PartitionOf returns the partition of an aggregate among partitions: a
// stable hash (FNV-1a) of its id, modulo partitions. The relay's
// publisher routes by it, and the reports use it to tell which partition
// a message waits in.
func PartitionOf(aggregateID string, partitions int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(aggregateID))
	return int(h.Sum32() % uint32(max(partitions, 1)))
}

// PartitionName is the name of partition k of a route.
func PartitionName(route string, k int) string {
	return route + PartitionSeparator + strconv.Itoa(k)
}

// RouteName returns the route a router handler name belongs to: the name
// itself, or the name without its suffix.
func RouteName(handlerName string) string {
	if i := strings.LastIndex(handlerName, PartitionSeparator); i >= 0 {
		return handlerName[:i]
	}
	return handlerName
}

// ConsumerQueue returns the queue (without namespace) a router handler
// consumes: a partition's own queue, the route's queue for one of its
// competing consumers ("<route>@w<k>"), or the route's backlog lane for one
// of that lane's consumers ("<route>@b<k>": BacklogQueue).
func ConsumerQueue(handlerName string) string {
	if i := strings.LastIndex(handlerName, PartitionSeparator); i >= 0 {
		switch suffix := handlerName[i+1:]; {
		case strings.HasPrefix(suffix, "w"):
			return handlerName[:i]
		case strings.HasPrefix(suffix, "b") && suffix != BacklogLane:
			return BacklogQueue(handlerName[:i])
		}
	}
	return handlerName
}

// BacklogLane names the broker's second lane of a topic that is not
// ordered, for the events of a tenant's backlog (tenancy): a queue of its
// own beside each route's, so that other tenants' new events do not wait
// behind a backlog at the broker.
const BacklogLane = "backlog"

// BacklogQueue is the name of route's backlog lane queue (without
// namespace).
func BacklogQueue(route string) string { return route + PartitionSeparator + BacklogLane }

// BacklogConsumer is the name of consumer k of route's backlog lane.
func BacklogConsumer(route string, k int) string {
	return route + PartitionSeparator + "b" + strconv.Itoa(k)
}

type laneKey struct{}

// ContextWithBacklogLane returns ctx asking the relay's publisher to send
// the events it publishes under it on their topic's backlog lane, when the
// topic has one (not ordered, lanes declared).
func ContextWithBacklogLane(ctx context.Context) context.Context {
	return context.WithValue(ctx, laneKey{}, BacklogLane)
}

// InBacklogLane reports whether ctx asks for the backlog lane.
func InBacklogLane(ctx context.Context) bool {
	return ctx != nil && ctx.Value(laneKey{}) == BacklogLane
}

// IsPartition reports whether a router handler consumes a partition of an
// ordered topic ("payments.charge@3"), where messages must be handled in order.
func IsPartition(handlerName string) bool {
	i := strings.LastIndex(handlerName, PartitionSeparator)
	if i < 0 || i == len(handlerName)-1 {
		return false
	}
	_, err := strconv.Atoi(handlerName[i+1:])
	return err == nil
}

// ReservedTopicPrefix starts the exchange names RabbitMQ keeps for itself:
// declaring or publishing to one is refused (403 ACCESS_REFUSED), and the
// channel is closed.
const ReservedTopicPrefix = "amq."

// FerryTopicPrefix starts the topics and exchanges Ferry keeps for itself:
// RetryTopic (durable retries) and the alternate exchange "ferry.unrouted".
// A producer's event on one would be routed where no route of its own
// consumes, or refused by the broker at every relay attempt.
const FerryTopicPrefix = "ferry."

// MaxTopicLength is the longest topic, in bytes: a route's name and topic
// share the rule (a queue is named after its route, with a partition
// suffix), and an exchange name with a namespace of up to 64 bytes stays
// within RabbitMQ's 255.
const MaxTopicLength = 200

// ValidateTopicName is the one rule for a topic, applied alike to a route's
// topic and to every event written into the outbox, so that a producer
// can write no topic that no route could consume: 1 to MaxTopicLength
// ASCII letters, digits and . _ : -, starting with a letter or digit; not
// in RabbitMQ's reserved "amq." namespace, nor in Ferry's own "ferry."
// (only Ferry's own writes use RetryTopic). A topic refused here would
// otherwise fail at the broker only after the business transaction
// committed.
func ValidateTopicName(topic string) error {
	switch {
	case topic == "":
		return fmt.Errorf("%w: topic is empty", ErrInvalidEvent)
	case len(topic) > MaxTopicLength:
		return fmt.Errorf("%w: topic %q… is %d bytes long; at most %d", ErrInvalidEvent, CleanText(topic, 40), len(topic), MaxTopicLength)
	case strings.HasPrefix(topic, ReservedTopicPrefix):
		return fmt.Errorf("%w: topic %q starts with %q, which RabbitMQ reserves for its own exchanges", ErrInvalidEvent, topic, ReservedTopicPrefix)
	case strings.HasPrefix(topic, FerryTopicPrefix):
		return fmt.Errorf("%w: topic %q starts with %q, which Ferry keeps for its own topics (%s, %sunrouted)", ErrInvalidEvent, topic, FerryTopicPrefix, RetryTopic, FerryTopicPrefix)
	case !alnum(rune(topic[0])) || strings.IndexFunc(topic, func(r rune) bool { return !topicRune(r) }) >= 0:
		return fmt.Errorf("%w: topic %q may hold only ASCII letters, digits and . _ : -, and starts with a letter or digit", ErrInvalidEvent, CleanText(topic, 100))
	}
	return nil
}

func alnum(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9'
}

func topicRune(r rune) bool {
	return alnum(r) || strings.ContainsRune("._:-", r)
}

// MaxPayloadBytes is the one payload limit: the outbox refuses a larger
// event before anything is written, and a typed handler refuses a larger
// message as one that did not come through Ferry. Large blobs belong in
// object storage, with a reference in the event.
const MaxPayloadBytes = 1 << 20
