package rabbit

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline"
)

// Names of the broker objects Ferry itself owns (before the namespace).
const (
	// UnroutedName is the alternate exchange of every topic exchange, and the
	// queue that keeps what no consumer queue was bound to take.
	UnroutedName = "ferry.unrouted"
)

// Binding says that queue (a handler's) receives topic's events. A binding
// of an ordered topic stands for Partitions queues, "<queue>@<k>".
type Binding struct {
	Topic string
	Queue string
}

// PartitionOf returns the partition of an aggregate (pipeline.PartitionOf).
func PartitionOf(aggregateID string, partitions int) int {
	return pipeline.PartitionOf(aggregateID, partitions)
}

// Topology names, declares and (for tests and demos) deletes Ferry's broker
// objects. It is Watermill's TopologyBuilder for publishers and subscribers
// built from its configs, so every declaration of one object carries the
// same arguments: RabbitMQ refuses a redeclaration that differs.
type Topology struct {
	cfg Config

	mu        sync.Mutex
	exchanges []string
	queues    []string
	// unroutedDeclared saves three round trips per exchange declaration.
	unroutedDeclared bool
}

// NewTopology returns the topology of cfg.
func NewTopology(cfg Config) (*Topology, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Topology{cfg: cfg}, nil
}

// Config returns the configuration the topology was built with (defaults applied).
func (t *Topology) Config() Config { return t.cfg }

// OrderedTopics returns the ordered topics, sorted: the one home of that
// set. The relay (through BatchPublisher) and the outbox's validation read
// it from here.
func (t *Topology) OrderedTopics() []string {
	out := slices.Clone(t.cfg.OrderedTopics)
	slices.Sort(out)
	return slices.Compact(out)
}

// Ordered reports whether topic is one of the ordered topics.
func (t *Topology) Ordered(topic string) bool { return slices.Contains(t.cfg.OrderedTopics, topic) }

// RoutingKey is the routing key of msg on topic: its aggregate's partition
// for an ordered topic, the queue that failed it for a durable retry, ""
// (every bound queue) otherwise.
func (t *Topology) RoutingKey(topic string, msg *message.Message) string {
	if topic == pipeline.RetryTopic {
		return msg.Metadata.Get(pipeline.MetaRetryQueue)
	}
	if !t.Ordered(topic) {
		return ""
	}
	return strconv.Itoa(PartitionOf(msg.Metadata.Get(pipeline.MetaAggregateID), t.cfg.Partitions))
}

// Subscription is one queue a handler consumes, with its watermill-amqp configuration.
type Subscription struct {
	// Name is the router handler's name: the handler's, "<handler>@<k>" for
	// partition k, or "<handler>@w<k>" for one of several consumers.
	Name string
	// Queue is the queue's full name (namespace included).
	Queue  string
	Config wamqp.Config
	// Ordered is true for a partition of an ordered topic: its consumer
	// holds one delivery at a time and never requeues it behind the ones
	// after it (see Consumer).
	Ordered bool
	// Lane is true for a consumer of a handler's backlog lane (see
	// Config.BacklogLanes): its queue is bound to the topic's lane exchange.
	Lane bool
}

// LaneExchangeName is the exchange of topic's backlog lane.
func (t *Topology) LaneExchangeName(topic string) string {
	return t.ExchangeName(topic) + pipeline.PartitionSeparator + pipeline.BacklogLane
}

// BacklogSubscriptions are the consumers of handler's backlog lane on
// topic: none for an ordered topic, or without Config.BacklogLanes.
func (t *Topology) BacklogSubscriptions(handler, topic string) []Subscription {
	if !t.cfg.BacklogLanes || t.Ordered(topic) || topic == pipeline.RetryTopic {
		return nil
	}
	lane := pipeline.BacklogQueue(handler)
	subs := make([]Subscription, t.cfg.BacklogConsumers)
	for k := range subs {
		subs[k] = Subscription{Name: pipeline.BacklogConsumer(handler, k), Queue: t.QueueName(lane), Config: t.SubscriberConfig(lane), Lane: true}
	}
	return subs
}

// exchangeFor is the exchange msg goes to on topic: its backlog lane's
// when the relay asks for it (pipeline.InBacklogLane) and the topic has
// one, the topic's otherwise.
func (t *Topology) exchangeFor(topic string, msg *message.Message) string {
	if t.cfg.BacklogLanes && !t.Ordered(topic) && topic != pipeline.RetryTopic && pipeline.InBacklogLane(msg.Context()) {
		return t.LaneExchangeName(topic)
	}
	return t.ExchangeName(topic)
}

// Subscription is the one consumer of handler's queue of an unordered
// topic, named as the handler.
func (t *Topology) Subscription(handler string) Subscription {
	return Subscription{Name: handler, Queue: t.QueueName(handler), Config: t.SubscriberConfig(handler)}
}

// Subscriptions returns the consumers handler runs for topic: Consumers
// competing consumers on its queue, or, when topic is ordered, one per
// partition queue (each processing one message at a time, which is what
// keeps the order).
func (t *Topology) Subscriptions(handler, topic string) []Subscription {
	if !t.Ordered(topic) {
		queue := t.QueueName(handler)
		if t.cfg.Consumers == 1 {
			return []Subscription{t.Subscription(handler)}
		}
		subs := make([]Subscription, t.cfg.Consumers)
		for k := range subs {
			// Same queue, its own router handler: "<handler>@w<k>".
			subs[k] = Subscription{Name: handler + pipeline.PartitionSeparator + "w" + strconv.Itoa(k), Queue: queue, Config: t.SubscriberConfig(handler)}
		}
		return subs
	}
	subs := make([]Subscription, t.cfg.Partitions)
	for k := range subs {
		name := pipeline.PartitionName(handler, k)
		subs[k] = Subscription{Name: name, Queue: t.QueueName(name), Config: t.partitionConfig(handler, k), Ordered: true}
	}
	return subs
}

// partitionConfig is SubscriberConfig for partition k of an ordered topic:
// its queue takes routing key k, admits one active consumer at a time
// (RabbitMQ's single-active-consumer: the others wait as hot standbys), and
// prefetches one message, so a consumer that dies returns at most one
// delivery and cannot reorder a backlog.
func (t *Topology) partitionConfig(handler string, k int) wamqp.Config {
	name := pipeline.PartitionName(handler, k)
	c := t.SubscriberConfig(name)
	key := strconv.Itoa(k)
	c.Queue.Arguments["x-single-active-consumer"] = true
	c.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return key }}
	c.Consume.Qos.PrefetchCount = 1
	return c
}

// ExchangeName is the exchange a topic's events are published to.
func (t *Topology) ExchangeName(topic string) string { return t.cfg.Namespace + topic }

// QueueName is the queue a handler consumes from.
func (t *Topology) QueueName(handler string) string { return t.cfg.Namespace + handler }

// PublisherConfig is the watermill-amqp configuration for publishing: to the
// topic's exchange, persistent, waiting for the broker's confirm of every
// message (Publish returns only once RabbitMQ has taken responsibility).
func (t *Topology) PublisherConfig() wamqp.Config {
	c := t.baseConfig()
	c.Publish = wamqp.PublishConfig{
		GenerateRoutingKey: func(string) string { return "" },
		ConfirmDelivery:    true,
		ChannelPoolSize:    t.cfg.PublishChannels,
	}
	return c
}

// SubscriberConfig is the watermill-amqp configuration for the consumer of
// one handler: its own queue, bound to the topic's exchange, and its own
// named connection (wamqp.NewSubscriber dials it).
func (t *Topology) SubscriberConfig(handler string) wamqp.Config {
	c := t.baseConfig()
	c.Connection = connectionConfig(t.cfg, "ferry-consumer-"+handler)
	queue := t.QueueName(handler)
	c.Queue = wamqp.QueueConfig{
		GenerateName: func(string) string { return queue },
		Durable:      true,
		Arguments:    t.queueArgs(),
	}
	c.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }}
	c.Consume = wamqp.ConsumeConfig{
		Consumer: handler,
		Qos:      wamqp.QosConfig{PrefetchCount: t.cfg.Prefetch},
		// A nack puts the delivery back: Ferry's middleware acks only what is
		// done or safely in the poison queue, so a nack means "try again".
		NoRequeueOnNack: false,
	}
	return c
}

func (t *Topology) baseConfig() wamqp.Config {
	return wamqp.Config{
		Connection: wamqp.ConnectionConfig{AmqpURI: t.cfg.URL},
		Marshaler:  Marshaler{},
		Exchange: wamqp.ExchangeConfig{
			GenerateName: t.ExchangeName,
			Type:         amqp.ExchangeDirect,
			Durable:      true,
			Arguments:    amqp.Table{"alternate-exchange": t.cfg.Namespace + UnroutedName},
		},
		TopologyBuilder: t,
	}
}

func (t *Topology) queueArgs() amqp.Table {
	return amqp.Table{"x-queue-type": t.cfg.QueueType}
}

// ExchangeDeclare implements watermill-amqp's TopologyBuilder. It declares
// the alternate exchange first, so no message published to the new exchange
// can be dropped for want of it.
func (t *Topology) ExchangeDeclare(ch *amqp.Channel, name string, c wamqp.Config) error {
	if err := t.declareUnrouted(ch); err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(name, c.Exchange.Type, c.Exchange.Durable, false, false, false, c.Exchange.Arguments); err != nil {
		return fmt.Errorf("declaring exchange %q: %w", name, err)
	}
	t.record(&t.exchanges, name)
	return nil
}

// BuildTopology implements watermill-amqp's TopologyBuilder: the queue, its
// topic's exchange, and the binding between them.
func (t *Topology) BuildTopology(ch *amqp.Channel, queue, exchange string, c wamqp.Config, _ watermill.LoggerAdapter) error {
	if _, err := ch.QueueDeclare(queue, c.Queue.Durable, false, false, false, c.Queue.Arguments); err != nil {
		return fmt.Errorf("declaring queue %q: %w", queue, err)
	}
	t.record(&t.queues, queue)
	if err := t.ExchangeDeclare(ch, exchange, c); err != nil {
		return err
	}
	key := ""
	if c.QueueBind.GenerateRoutingKey != nil {
		key = c.QueueBind.GenerateRoutingKey(queue)
	}
	if err := ch.QueueBind(queue, key, exchange, false, nil); err != nil {
		return fmt.Errorf("binding queue %q to exchange %q: %w", queue, exchange, err)
	}
	// Durable retries come back through the retry exchange, addressed to
	// this queue alone.
	retry := t.ExchangeName(pipeline.RetryTopic)
	if err := t.ExchangeDeclare(ch, retry, c); err != nil {
		return err
	}
	if err := ch.QueueBind(queue, strings.TrimPrefix(queue, t.cfg.Namespace), retry, false, nil); err != nil {
		return fmt.Errorf("binding queue %q to the retry exchange: %w", queue, err)
	}
	return nil
}

func (t *Topology) declareUnrouted(ch *amqp.Channel) error {
	t.mu.Lock()
	done := t.unroutedDeclared
	t.mu.Unlock()
	if done {
		return nil
	}
	name := t.cfg.Namespace + UnroutedName
	if err := ch.ExchangeDeclare(name, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declaring exchange %q: %w", name, err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, t.queueArgs()); err != nil {
		return fmt.Errorf("declaring queue %q: %w", name, err)
	}
	if err := ch.QueueBind(name, "", name, false, nil); err != nil {
		return fmt.Errorf("binding queue %q: %w", name, err)
	}
	t.record(&t.exchanges, name)
	t.record(&t.queues, name)
	t.mu.Lock()
	t.unroutedDeclared = true
	t.mu.Unlock()
	return nil
}

// Declare creates every exchange, queue and binding in bindings (and the
// unrouted safety net) over conn. Call it before relaying: a message relayed
// before its queues exist would land in ferry.unrouted instead.
func (t *Topology) Declare(conn *amqp.Connection, bindings ...Binding) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("opening channel to declare topology: %w", err)
	}
	defer ch.Close()
	if err := t.declareUnrouted(ch); err != nil {
		return err
	}
	for _, b := range bindings {
		if b.Topic == "" || b.Queue == "" {
			return errors.New("rabbit: a binding needs a topic and a queue")
		}
		declared := map[string]bool{}
		for _, sub := range append(t.Subscriptions(b.Queue, b.Topic), t.BacklogSubscriptions(b.Queue, b.Topic)...) {
			if declared[sub.Queue] {
				continue // competing consumers share one queue
			}
			declared[sub.Queue] = true
			exchange := t.ExchangeName(b.Topic)
			if sub.Lane {
				exchange = t.LaneExchangeName(b.Topic)
			}
			if err := t.BuildTopology(ch, sub.Queue, exchange, sub.Config, nil); err != nil {
				return err
			}
		}
	}
	return nil
}

// QueueDepth returns how many messages wait in a queue (by its full name).
func QueueDepth(conn *amqp.Connection, queue string) (int, error) {
	st, err := QueueStats(conn, queue)
	return st.Ready, err
}

// QueueStat is what a passive declare tells of a queue: the messages
// ready for delivery (not those delivered and unacked) and its consumers.
type QueueStat struct {
	Queue     string `json:"queue"`
	Ready     int    `json:"ready"`
	Consumers int    `json:"consumers"`
	// Handler is who consumes it, when the caller knows (app.QueueStats
	// does): a partition of an ordered route ("payments.charge@3"), or the
	// route whose workers share it.
	Handler string `json:"handler,omitempty"`
}

// QueueStats inspects queue with a passive declare, on a channel of its
// own (a missing queue closes the channel).
func QueueStats(conn *amqp.Connection, queue string) (QueueStat, error) {
	ch, err := conn.Channel()
	if err != nil {
		return QueueStat{Queue: queue}, fmt.Errorf("opening channel: %w", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return QueueStat{Queue: queue}, fmt.Errorf("inspecting queue %q: %w", queue, err)
	}
	return QueueStat{Queue: queue, Ready: q.Messages, Consumers: q.Consumers}, nil
}

// IsQueueMissing reports whether err says a queue does not exist (a
// passive declare's 404): the broker answered, the topology is not
// declared yet. Not to be reported as an unreachable broker.
func IsQueueMissing(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.NotFound
}

// Purge empties every queue this Topology declared. It is for demos that
// start over.
func (t *Topology) Purge(conn *amqp.Connection) error {
	t.mu.Lock()
	queues := slices.Clone(t.queues)
	t.mu.Unlock()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("opening channel for purge: %w", err)
	}
	defer ch.Close()
	for _, q := range queues {
		if _, err := ch.QueuePurge(q, false); err != nil {
			return fmt.Errorf("purging queue %q: %w", q, err)
		}
	}
	return nil
}

// Teardown deletes every exchange and queue this Topology declared, with
// their messages. It is for tests and demos that own their namespace.
func (t *Topology) Teardown(conn *amqp.Connection) error {
	t.mu.Lock()
	queues, exchanges := slices.Clone(t.queues), slices.Clone(t.exchanges)
	t.queues, t.exchanges, t.unroutedDeclared = nil, nil, false
	t.mu.Unlock()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("opening channel for teardown: %w", err)
	}
	defer ch.Close()
	var errs []error
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			errs = append(errs, fmt.Errorf("deleting queue %q: %w", q, err))
		}
	}
	for _, e := range exchanges {
		if err := ch.ExchangeDelete(e, false, false); err != nil {
			errs = append(errs, fmt.Errorf("deleting exchange %q: %w", e, err))
		}
	}
	return errors.Join(errs...)
}

func (t *Topology) record(list *[]string, name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !slices.Contains(*list, name) {
		*list = append(*list, name)
	}
}
