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

	"github.com/ferry-dev/ferry/pipeline"
)

// Consumer is a Watermill subscriber of one queue (a Subscription) that
// hands up to InFlight deliveries to the router at once and acknowledges
// them in delivery order, many with one frame (multiple=true).
//
// Written here rather than taken from watermill-amqp because its subscriber
// holds one delivery at a time per channel and acks each with a frame of its
// own (a batch route, handlers.Batch, needs many deliveries in hand to
// commit them together), and because of how it stops: it nacks with
// requeue what its handlers still hold, and on a quorum queue a requeued
// message goes behind the ones after it. A Consumer never requeues a
// delivery of an ordered queue: what it cannot settle goes back with its
// channel's close, which RabbitMQ returns to the head of the queue
// (measured on 3.10 with quorum queues: TestBrokerReturnsAClosedChannelsDeliveryFirst).
//
// With DrainTimeout set, a stop drains (see ConsumerConfig.DrainTimeout).
type Consumer struct {
	conn   *wamqp.ConnectionWrapper
	topo   *Topology
	sub    Subscription
	cfg    ConsumerConfig
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup
}

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	// InFlight is how many unacknowledged deliveries the consumer hands
	// out at once (the channel's prefetch is raised to it if lower).
	// Default 1; an ordered Subscription takes 1 only.
	InFlight int
	// DrainTimeout, if positive, makes a stop (Close, or the end of
	// Subscribe's context) graceful: the consumer hands out no new
	// delivery, lets the handlers finish those they hold, for at most
	// DrainTimeout, settles them, then closes its channel; what it had
	// received and not handed out, and what is still unsettled at the
	// timeout, goes back with the channel, first in line. Meanwhile the
	// messages' contexts stay alive (a cancelled one would cut a handler
	// between its effect and its ledger commit, and the effect would run
	// twice); pipeline.Stopping(ctx) tells what only waits (a held
	// partition, an outage) to give up instead. Zero: a stop cancels the
	// messages' contexts at once, as Watermill's Pub/Sub contract has it.
	DrainTimeout time.Duration
	// Paused, if set, says whether the consumer's route is paused by an
	// operator; it is asked every PausePoll. While it says yes the
	// consumer takes no delivery: those in handlers finish, or give up
	// what only waits (pipeline.Stopping: the pause link, a held head, an
	// outage) and go back; then the channel closes, returning what was
	// received and not handed out first in line, and the consumer
	// consumes again once it says no. The route's messages wait at the
	// broker, none of them unacked: RabbitMQ's consumer_timeout (30 min
	// by default), which closes a channel holding a delivery unacked that
	// long and redelivers it, has nothing to time out however long the
	// pause, and each message goes back once per pause, not once per
	// timeout.
	Paused func() bool
	// PausePoll is how often Paused is asked. Default 2s.
	PausePoll time.Duration
	// Draining, if set, is told when a stop begins with deliveries in
	// handlers (the drain waits for them): a deploy's stop met work in
	// flight. The chaos runs count these.
	Draining func(inHandlers int)
	// StepAside, if set, says whether this process cannot do the route's
	// work now (its database out of reach); it is asked every PausePoll,
	// as Paused is. While it says yes the consumer detaches as for a
	// pause, except that its handlers get StepAsideGrace to finish: one
	// stuck on the dead link would hold its delivery, and an ordered
	// partition's single active consumer slot, until the link came back.
	// Past the grace the channel closes and what the handlers still hold
	// goes back to the queue, for a process that can reach the database
	// (a handler whose effect ran and whose ledger commit could not is run
	// there again, and the effect's idempotency key keeps it single). It
	// consumes again once StepAside says no.
	StepAside func() bool
	// StepAsideGrace is how long a step aside waits for the handlers.
	// Default 2s.
	StepAsideGrace time.Duration
}

// DefaultStepAsideGrace is ConsumerConfig.StepAsideGrace's default.
const DefaultStepAsideGrace = 2 * time.Second

// DefaultPausePoll is ConsumerConfig.PausePoll's default.
const DefaultPausePoll = 2 * time.Second

var _ message.Subscriber = (*Consumer)(nil)

// errGivenBack ends a channel whose ordered delivery was nacked: closing
// the channel returns it first in line, where a requeue would not.
var errGivenBack = errors.New("an ordered delivery was not settled: the channel closes to give it back first in line")

// LostUnsettled ends the error of a channel lost with deliveries
// unsettled (the count before it): the broker gives them to another
// consumer, and an ack sent for them meanwhile is lost. The chaos runs
// count such losses as faults that met work in flight.
const LostUnsettled = "deliveries unsettled went back to the broker with the channel"

var errUnsettled = errors.New(LostUnsettled)

// errPaused ends a channel whose route was paused, once its handlers hold
// nothing (ConsumerConfig.Paused).
var errPaused = errors.New("the route is paused: the channel closes, its deliveries wait at the broker until it is resumed")

// errSteppedAside ends a channel whose process cannot do the route's work
// (ConsumerConfig.StepAside).
var errSteppedAside = errors.New("this process cannot reach its database: the channel closes, its deliveries go to consumers that can")

// NewConsumer returns a consumer of sub's queue over conn.
func NewConsumer(conn *wamqp.ConnectionWrapper, topo *Topology, sub Subscription, cfg ConsumerConfig, logger watermill.LoggerAdapter) (*Consumer, error) {
	if conn == nil || topo == nil {
		return nil, errors.New("rabbit: NewConsumer needs a connection and a topology")
	}
	if cfg.InFlight == 0 {
		cfg.InFlight = 1
	}
	if cfg.InFlight < 1 {
		return nil, fmt.Errorf("rabbit: ConsumerConfig.InFlight must be at least 1, got %d", cfg.InFlight)
	}
	if sub.Ordered && cfg.InFlight != 1 {
		return nil, fmt.Errorf("rabbit: %s is an ordered partition: ConsumerConfig.InFlight must be 1, got %d", sub.Queue, cfg.InFlight)
	}
	if cfg.DrainTimeout < 0 {
		return nil, fmt.Errorf("rabbit: ConsumerConfig.DrainTimeout must not be negative, got %s", cfg.DrainTimeout)
	}
	if cfg.PausePoll == 0 {
		cfg.PausePoll = DefaultPausePoll
	}
	if cfg.PausePoll < 0 {
		return nil, fmt.Errorf("rabbit: ConsumerConfig.PausePoll must be positive, got %s", cfg.PausePoll)
	}
	if cfg.StepAsideGrace == 0 {
		cfg.StepAsideGrace = DefaultStepAsideGrace
	}
	if cfg.StepAsideGrace < 0 {
		return nil, fmt.Errorf("rabbit: ConsumerConfig.StepAsideGrace must be positive, got %s", cfg.StepAsideGrace)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Consumer{conn: conn, topo: topo, sub: sub, cfg: cfg, logger: logger, closing: make(chan struct{})}, nil
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
	if c.sub.Lane {
		exchange = c.topo.LaneExchangeName(topic)
	}
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
			if !c.awaitResume(ctx, fields) {
				return
			}
			select {
			case <-c.conn.Connected():
			case <-c.closing:
				return
			case <-ctx.Done():
				return
			}
			switch err := c.consume(ctx, out); {
			case errors.Is(err, errGivenBack):
				c.logger.Info("Reopening the channel: "+err.Error(), fields)
			case errors.Is(err, errSteppedAside) && errors.Is(err, errUnsettled):
				// Handlers were stuck on the dead link: worth an operator's
				// eye, unlike a quiet detach.
				c.logger.Error("Consumer stepped aside", err, fields)
			case errors.Is(err, errPaused), errors.Is(err, errSteppedAside):
				c.logger.Info("Consumer detached: "+err.Error(), fields)
			case err != nil:
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

// awaitResume waits while the route is paused (ConsumerConfig.Paused) or
// the process steps aside (StepAside); false when the consumer stops
// meanwhile.
func (c *Consumer) awaitResume(ctx context.Context, fields watermill.LogFields) bool {
	if !c.detached() {
		return true
	}
	t := time.NewTicker(c.cfg.PausePoll)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-c.closing:
			return false
		case <-ctx.Done():
			return false
		}
		if !c.detached() {
			c.logger.Info("Consuming again", fields)
			return true
		}
	}
}

// detached says whether the consumer must take no delivery now.
func (c *Consumer) detached() bool {
	return c.stepAside() || c.cfg.Paused != nil && c.cfg.Paused()
}

func (c *Consumer) stepAside() bool { return c.cfg.StepAside != nil && c.cfg.StepAside() }

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

// pending is a delivery received and not yet settled.
type pending struct {
	msg    *message.Message
	tag    uint64
	cancel context.CancelFunc
}

// consume runs one channel until it closes, ctx ends or the consumer is
// closed (after a drain, with DrainTimeout). It settles deliveries
// strictly in delivery order: an ack of the oldest pending delivery takes
// every acked one after it along in one multiple=true frame; a nack
// settles that delivery alone, with a requeue, except on an ordered queue,
// where the channel closes instead (errGivenBack). A later delivery acked
// before an earlier one waits for it, holding its slot, never its handler.
func (c *Consumer) consume(ctx context.Context, out chan<- *message.Message) error {
	ch, err := c.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("opening a channel: %w", err)
	}
	defer ch.Close()
	prefetch := c.sub.Config.Consume.Qos.PrefetchCount
	if prefetch < c.cfg.InFlight {
		prefetch = c.cfg.InFlight
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
		window []pending        // received, oldest first
		next   *message.Message // the newest delivery, not yet handed to the router
		in     <-chan amqp.Delivery
		send   chan<- *message.Message
		// The drain: stop is closed when it begins (pipeline.Stopping),
		// drained fires at its timeout. A pause closes stop too and takes
		// no delivery; its channel closes once the handlers hold nothing.
		stop     = make(chan struct{})
		draining bool
		pausing  bool
		drained  <-chan time.Time
		stopped  = c.closing
		ctxDone  = ctx.Done()
		pauseAsk <-chan time.Time
		// aside: the pause is the process stepping aside; graceUp fires
		// at the end of its grace.
		aside   bool
		graceUp <-chan time.Time
	)
	// Only this loop closes stop: a pause and a drain can both ask.
	signalStop := func() {
		if !isClosed(stop) {
			close(stop)
		}
	}
	if c.cfg.Paused != nil || c.cfg.StepAside != nil {
		t := time.NewTicker(c.cfg.PausePoll)
		defer t.Stop()
		pauseAsk = t.C
	}
	requeue := !c.sub.Config.Consume.NoRequeueOnNack
	// lost says how many deliveries a lost channel took back with it.
	lost := func(err error) error {
		if n := len(window); n > 0 {
			return fmt.Errorf("%w: %d %w", err, n, errUnsettled)
		}
		return err
	}
	// A message's context ends once it is settled or the channel is gone
	// (Watermill's contract: the handler's work for it is over).
	defer func() {
		for _, p := range window {
			p.cancel()
		}
	}()
	// beginDrain starts the drain at a stop; false when there is none to
	// run (no DrainTimeout).
	beginDrain := func(handedOut int) bool {
		stopped, ctxDone = nil, nil
		if c.cfg.DrainTimeout == 0 {
			return false
		}
		draining = true
		if handedOut > 0 && c.cfg.Draining != nil {
			c.cfg.Draining(handedOut)
		}
		signalStop()
		t := time.NewTimer(c.cfg.DrainTimeout)
		drained = t.C
		return true
	}
	for {
		handedOut := len(window)
		if next != nil {
			handedOut--
		}
		if draining && handedOut == 0 {
			return nil
		}
		if pausing && handedOut == 0 {
			if aside {
				return errSteppedAside
			}
			return errPaused
		}
		in, send = nil, nil
		if !draining && !pausing {
			if next != nil {
				send = out
			} else if len(window) < c.cfg.InFlight {
				in = deliveries
			}
		}
		var acked, nacked <-chan struct{}
		if len(window) > 0 {
			acked, nacked = window[0].msg.Acked(), window[0].msg.Nacked()
		}
		select {
		case d, ok := <-in:
			if !ok {
				return lost(errors.New("the broker closed the delivery stream"))
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
			var mctx context.Context
			var cancel context.CancelFunc
			switch {
			case c.cfg.DrainTimeout > 0:
				// Not ended by ctx: a stop drains (see DrainTimeout).
				mctx, cancel = context.WithCancel(pipeline.WithStopping(context.WithoutCancel(ctx), stop))
			case c.cfg.Paused != nil || c.cfg.StepAside != nil:
				mctx, cancel = context.WithCancel(pipeline.WithStopping(ctx, stop))
			default:
				mctx, cancel = context.WithCancel(ctx)
			}
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
			if c.sub.Ordered {
				// Left unsettled: the deferred close gives it back.
				return errGivenBack
			}
			tag := window[0].tag
			window[0].cancel()
			window = window[1:]
			if err := ch.Nack(tag, false, requeue); err != nil {
				return fmt.Errorf("nacking: %w", err)
			}
		case amqpErr := <-closed:
			err := errors.New("channel closed")
			if amqpErr != nil {
				err = amqpErr
			}
			return lost(err)
		case <-stopped:
			if !beginDrain(handedOut) {
				return nil
			}
		case <-ctxDone:
			if !beginDrain(handedOut) {
				return nil
			}
		case <-pauseAsk:
			if pausing || draining {
				break
			}
			if c.stepAside() {
				pausing, aside = true, true
				graceUp = time.After(c.cfg.StepAsideGrace)
				signalStop()
			} else if c.cfg.Paused != nil && c.cfg.Paused() {
				pausing = true
				signalStop()
			}
		case <-graceUp:
			// What the handlers still hold goes back with the channel
			// (the deferred cancels end their contexts: a statement stuck
			// on the dead link returns).
			return fmt.Errorf("%w: %d %w", errSteppedAside, handedOut, errUnsettled)
		case <-drained:
			c.logger.Info("Drain timed out; the deliveries still in handlers go back to the queue with the channel", watermill.LogFields{
				"amqp_queue_name": c.sub.Queue, "in_handlers": handedOut, "drain_timeout": c.cfg.DrainTimeout.String(),
			})
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

// Close stops consuming, after a drain when DrainTimeout is set;
// unsettled deliveries go back to the queue, first in line, when the
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
