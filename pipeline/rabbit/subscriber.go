package rabbit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

// SubscriberConfig configures a Subscriber.
type SubscriberConfig struct {
	// Group is the consumer group: subscribers of one group share a queue
	// per topic and compete for its messages; every group gets every
	// message. Default "": the group is the topic itself, so all
	// subscribers without a group share one queue per topic.
	Group string
	// InFlight is how many deliveries each of its consumers hands out
	// before the oldest is settled (acks of many go in one frame). Default
	// 1, as watermill-amqp's subscriber. Ordered topics' partitions always
	// take 1, which is what keeps their order.
	InFlight int
	// DrainTimeout, if positive, makes Close drain: the handlers finish
	// what they hold, for at most this long (ConsumerConfig.DrainTimeout).
	// Default 0: Close cancels the messages' contexts at once (Watermill's
	// Pub/Sub contract); unsettled messages go back to their queues.
	DrainTimeout time.Duration
}

// Subscriber is a Watermill subscriber by topic over Ferry's topology: with
// the outbox publisher (pgoutbox.Outbox.Publisher) and the relay it makes
// Ferry a Watermill Pub/Sub, checked by Watermill's universal test suite.
// Each (group, topic) has a durable queue bound to the topic's exchange; an
// ordered topic has one partition queue per partition, each consumed one
// message at a time, merged into the subscription's channel.
//
// Ferry's route tables (app.App.Mount) name queues after handlers instead;
// use this subscriber for plain Watermill handlers and the CQRS component.
type Subscriber struct {
	topo     *Topology
	conn     *wamqp.ConnectionWrapper
	ownsC    bool
	group    string
	inFlight int
	drain    time.Duration
	logger   watermill.LoggerAdapter

	mu     sync.Mutex
	subs   []*Consumer
	closed bool
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber returns a subscriber over conn, or over a connection of its
// own when conn is nil (closed with the subscriber).
func NewSubscriber(conn *wamqp.ConnectionWrapper, topo *Topology, cfg SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if topo == nil {
		return nil, errors.New("rabbit: NewSubscriber needs a topology")
	}
	if cfg.Group != "" && !validQueuePart(cfg.Group) {
		return nil, fmt.Errorf("rabbit: consumer group %q must be 1 to 200 characters of letters, digits and . _ : -", cfg.Group)
	}
	if cfg.InFlight < 0 {
		return nil, fmt.Errorf("rabbit: SubscriberConfig.InFlight must not be negative, got %d", cfg.InFlight)
	}
	if cfg.InFlight == 0 {
		cfg.InFlight = 1
	}
	if cfg.DrainTimeout < 0 {
		return nil, fmt.Errorf("rabbit: SubscriberConfig.DrainTimeout must not be negative, got %s", cfg.DrainTimeout)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	s := &Subscriber{topo: topo, conn: conn, group: cfg.Group, inFlight: cfg.InFlight, drain: cfg.DrainTimeout, logger: logger}
	if conn == nil {
		c, err := Dial(topo.cfg, "ferry-subscriber", logger)
		if err != nil {
			return nil, err
		}
		s.conn, s.ownsC = c, true
	}
	return s, nil
}

func validQueuePart(s string) bool {
	if s == "" || len(s) > 200 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == ':' || r == '-') {
			return false
		}
	}
	return true
}

// queueBase is the queue (before namespace and partition suffix) of topic
// for this subscriber's group.
func (s *Subscriber) queueBase(topic string) string {
	if s.group == "" {
		return topic
	}
	return s.group + "." + topic
}

// subscriptions are the queues a subscription of topic consumes: one, or
// one per partition for an ordered topic.
func (s *Subscriber) subscriptions(topic string) []Subscription {
	base := s.queueBase(topic)
	if !s.topo.Ordered(topic) {
		return []Subscription{{Name: base, Queue: s.topo.QueueName(base), Config: s.topo.SubscriberConfig(base)}}
	}
	return s.topo.Subscriptions(base, topic)
}

// SubscribeInitialize declares the group's queue(s) for topic and binds
// them, so that messages relayed before the first Subscribe wait there.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if err := s.topo.Declare(s.conn.Connection(), Binding{Topic: topic, Queue: s.queueBase(topic)}); err != nil {
		return fmt.Errorf("initializing subscription to %q: %w", topic, err)
	}
	return nil
}

// Subscribe consumes topic in the subscriber's group. The channel closes
// when ctx ends or the subscriber is closed; an unacked message is nacked
// and redelivered.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	var outs []<-chan *message.Message
	inFlight := s.inFlight
	if s.topo.Ordered(topic) {
		inFlight = 1
	}
	for _, sub := range s.subscriptions(topic) {
		ws, err := NewConsumer(s.conn, s.topo, sub, ConsumerConfig{InFlight: inFlight, DrainTimeout: s.drain}, s.logger)
		if err != nil {
			return nil, fmt.Errorf("subscribing to %q: %w", topic, err)
		}
		if !s.track(ws) {
			_ = ws.Close()
			return nil, errors.New("rabbit: subscriber is closed")
		}
		ch, err := ws.Subscribe(ctx, topic)
		if err != nil {
			return nil, fmt.Errorf("subscribing to %q (queue %s): %w", topic, sub.Queue, err)
		}
		outs = append(outs, ch)
	}
	if len(outs) == 1 {
		return outs[0], nil
	}
	return merge(outs), nil
}

func (s *Subscriber) track(ws *Consumer) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.subs = append(s.subs, ws)
	return true
}

// merge fans the partition channels into one, closed when all are.
func merge(ins []<-chan *message.Message) <-chan *message.Message {
	out := make(chan *message.Message)
	var wg sync.WaitGroup
	for _, in := range ins {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range in {
				out <- m
			}
		}()
	}
	go func() { wg.Wait(); close(out) }()
	return out
}

// Close ends every subscription (their channels close) and the connection
// if the subscriber dialed it.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	subs := s.subs
	s.mu.Unlock()
	var errs []error
	for _, ws := range subs {
		errs = append(errs, ws.Close())
	}
	if s.ownsC {
		errs = append(errs, s.conn.Close())
	}
	return errors.Join(errs...)
}
