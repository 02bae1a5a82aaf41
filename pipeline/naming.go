package pipeline

import (
	"fmt"
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
// consumes: a partition's own queue, or the route's queue for one of its
// competing consumers ("<route>@w<k>").
func ConsumerQueue(handlerName string) string {
	if i := strings.LastIndex(handlerName, PartitionSeparator); i >= 0 && strings.HasPrefix(handlerName[i+1:], "w") {
		return handlerName[:i]
	}
	return handlerName
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

// ValidateTopicName refuses a topic that can never become an exchange:
// one in RabbitMQ's reserved "amq." namespace, or one holding a character
// other than ASCII letters, digits and - $ : . _ (watermill-sql's rule for
// topics, which the outbox's publisher applies). Publishing to a reserved
// name fails at the broker only after the business transaction committed;
// refusing it at publish time keeps it out of the outbox.
func ValidateTopicName(topic string) error {
	switch {
	case strings.HasPrefix(topic, ReservedTopicPrefix):
		return fmt.Errorf("%w: topic %q starts with %q, which RabbitMQ reserves for its own exchanges", ErrInvalidEvent, topic, ReservedTopicPrefix)
	case strings.IndexFunc(topic, func(r rune) bool { return !topicRune(r) }) >= 0:
		return fmt.Errorf("%w: topic %q may hold only ASCII letters, digits and - $ : . _", ErrInvalidEvent, CleanText(topic, 100))
	}
	return nil
}

func topicRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-$:._", r)
}
