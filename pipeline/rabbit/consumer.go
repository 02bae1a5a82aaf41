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
	amqp "github.com/rabbitmq/amqp091-go"
)

// Consumer is a Watermill subscriber of one queue (a Subscription) that
// hands up to InFlight deliveries to the router at once and acknowledges
// them in delivery order, many with one frame (multiple=true).
//
// Written here rather than taken from watermill-amqp because its subscriber
// holds one delivery at a time per channel and acks each with a frame of its
// own: a batch route (handlers.Batch) needs many deliveries in hand to
// commit them together, and per message the ack frame and the subscriber's
// goroutine hand-offs cost more CPU than the ledger's share of a batch.
// With InFlight 1 it behaves as watermill-amqp's subscriber does.
type Consumer struct {
	conn     *wamqp.ConnectionWrapper
	topo     *Topology
	sub      Subscription
	inFlight int
	logger   watermill.LoggerAdapter

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup
}

var _ message.Subscriber = (*Consumer)(nil)

// NewConsumer returns a consumer of sub's queue over conn, holding at most
// inFlight unacknowledged deliveries (the channel's prefetch is raised to
// inFlight if lower). Ordered partitions need inFlight 1.
func NewConsumer(conn *wamqp.ConnectionWrapper, topo *Topology, sub Subscription, inFlight int, logger watermill.LoggerAdapter) (*Consumer, error) {
	if conn == nil || topo == nil {
		return nil, errors.New("rabbit: NewConsumer needs a connection and a topology")
	}
	if inFlight < 1 {
		return nil, fmt.Errorf("rabbit: a consumer's deliveries in flight must be at least 1, got %d", inFlight)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Consumer{conn: conn, topo: topo, sub: sub, inFlight: inFlight, logger: logger, closing: make(chan struct{})}, nil
}

// Subscribe declares the queue and its bindings to topic's exchange and
// consumes it until ctx ends or the consumer is closed, reopening the
// channel after a connection loss (deliveries not acked by then are
// redelivered by the broker). The returned channel closes when it stops.
func (c *Consumer) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errors.New("rabbit: consumer is closed")
	}
	exchange := c.topo.ExchangeName(topic)
	if err := c.declare(exchange); err != nil {
		return nil, fmt.Errorf("subscribing %s to %q: %w", c.sub.Queue, topic, err)
	}
	out := make(chan *message.Message)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(out)
		fields := watermill.LogFields{"amqp_queue_name": c.sub.Queue, "topic": topic}
		for first := true; ; first = false {
			if !first {
				// As watermill-amqp's subscriber: a pause, then the
				// topology again (a new node may not have the queue yet).
				select {
				case <-time.After(100 * time.Millisecond):
				case <-c.closing:
					return
				case <-ctx.Done():
					return
				}
				if err := c.declare(exchange); err != nil {
					c.logger.Error("Declaring the queue again after a channel loss failed", err, fields)
				}
			}
			select {
			case <-c.conn.Connected():
			case <-c.closing:
				return
			case <-ctx.Done():
				return
			}
			if err := c.consume(ctx, out); err != nil {
				c.logger.Error("Consuming stopped; reopening", err, fields)
			}
			select {
			case <-c.closing:
				return
			case <-ctx.Done():
				return
			default:
			}
		}
	}()
	return out, nil
}

func (c *Consumer) declare(exchange string) error {
	if !c.conn.IsConnected() {
		return errors.New("not connected to RabbitMQ")
	}
	ch, err := c.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("opening a channel: %w", err)
	}
	defer ch.Close()
	return c.topo.BuildTopology(ch, c.sub.Queue, exchange, c.sub.Config, c.logger)
}

// pending is a delivery handed to the router and not yet settled.
type pending struct {
	msg    *message.Message
	tag    uint64
	cancel context.CancelFunc
}

// consume runs one channel until it closes, ctx ends or the consumer is
// closed. It settles deliveries strictly in delivery order: an ack of the
// oldest pending delivery takes every acked one after it along in one
// multiple=true frame; a nack (requeue) settles that delivery alone. A
// later delivery acked before an earlier one waits for it, holding its
// slot, never its handler.
func (c *Consumer) consume(ctx context.Context, out chan<- *message.Message) error {
	ch, err := c.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("opening a channel: %w", err)
	}
	defer ch.Close()
	prefetch := c.sub.Config.Consume.Qos.PrefetchCount
	if prefetch < c.inFlight {
		prefetch = c.inFlight
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return fmt.Errorf("setting prefetch: %w", err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	deliveries, err := ch.Consume(c.sub.Queue, c.sub.Config.Consume.Consumer, false, false, false, false, c.sub.Config.Consume.Arguments)
	if err != nil {
		return fmt.Errorf("consuming %s: %w", c.sub.Queue, err)
	}
	var (
		window []pending        // handed out or about to be, oldest first
		next   *message.Message // the newest delivery, not yet handed to the router
		in     <-chan amqp.Delivery
		send   chan<- *message.Message
	)
	requeue := !c.sub.Config.Consume.NoRequeueOnNack
	// A message's context ends once it is settled or the channel is gone
	// (Watermill's contract: the handler's work for it is over).
	defer func() {
		for _, p := range window {
			p.cancel()
		}
	}()
	for {
		in, send = nil, nil
		if next != nil {
			send = out
		} else if len(window) < c.inFlight {
			in = deliveries
		}
		var acked, nacked <-chan struct{}
		if len(window) > 0 {
			acked, nacked = window[0].msg.Acked(), window[0].msg.Nacked()
		}
		select {
		case d, ok := <-in:
			if !ok {
				return errors.New("the broker closed the delivery stream")
			}
			msg, err := c.sub.Config.Marshaler.Unmarshal(d)
			if err != nil {
				// Ferry's Marshaler never fails; another one's failure is
				// the delivery's, put back as watermill-amqp does.
				c.logger.Error("Cannot unmarshal a delivery; nacking it", err, nil)
				if err := d.Nack(false, requeue); err != nil {
					return err
				}
				continue
			}
			mctx, cancel := context.WithCancel(ctx)
			msg.SetContext(mctx)
			window = append(window, pending{msg: msg, tag: d.DeliveryTag, cancel: cancel})
			next = msg
		case send <- next:
			next = nil
		case <-acked:
			last := window[0].tag
			window[0].cancel()
			window = window[1:]
			for len(window) > 0 && window[0].msg != next && isClosed(window[0].msg.Acked()) {
				last = window[0].tag
				window[0].cancel()
				window = window[1:]
			}
			if err := ch.Ack(last, true); err != nil {
				return fmt.Errorf("acking: %w", err)
			}
		case <-nacked:
			tag := window[0].tag
			window[0].cancel()
			window = window[1:]
			if err := ch.Nack(tag, false, requeue); err != nil {
				return fmt.Errorf("nacking: %w", err)
			}
		case err := <-closed:
			if err == nil {
				return errors.New("channel closed")
			}
			return err
		case <-c.closing:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Close stops consuming; unacked deliveries go back to the queue when the
// channel closes. It waits for the subscriptions to end.
func (c *Consumer) Close() error {
	c.mu.Lock()
	if !c.closed {
		c.closed = true
		close(c.closing)
	}
	c.mu.Unlock()
	c.wg.Wait()
	return nil
}
