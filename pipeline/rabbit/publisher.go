package rabbit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline"
)

// Outgoing is one message of a batch, with its topic.
type Outgoing = pipeline.Outgoing

var _ pipeline.BatchPublisher = (*BatchPublisher)(nil)

// BatchPublisher publishes a batch with pipelined publisher confirms: every
// message of the batch is sent, then every confirm awaited, so a batch costs
// about one round trip instead of one per message. watermill-amqp's
// Publisher waits for each message's confirm before sending the next
// (publishMessage calls channel.Delivered() per message), which caps a relay
// at one message per broker round trip; this publisher exists for that one
// reason and otherwise reuses watermill-amqp's reconnecting connection, the
// Topology's names and the Marshaler.
//
// Within one channel RabbitMQ keeps publish order, and a batch goes out on
// one channel, so the order of a batch is the order in the queues.
//
// It is safe for concurrent use: each concurrent batch takes its own
// channel from a pool of Config.PublishChannels.
type BatchPublisher struct {
	conn *wamqp.ConnectionWrapper
	topo *Topology

	channels chan *amqp.Channel // idle confirm-mode channels
	slots    chan struct{}      // bounds channels in use

	mu       sync.Mutex
	declared map[string]bool // exchanges declared by this publisher
	closed   bool

	// silent is set when the broker left a call unanswered past the
	// caller's deadline (a confirm, a channel open) while the connection
	// looked up: a black hole (packets dropped, the connection kept open)
	// that the heartbeat notices only after three intervals. Meanwhile
	// every publish would wait out the caller's deadline again, holding
	// what the caller holds (the relay's position); so until a channel
	// opens again (probe, in the background), publishes fail at once as
	// the publisher's outage.
	silent  atomic.Bool
	probing atomic.Bool
}

// silentProbeTimeout bounds each background look for the broker's answer
// after it went silent.
const silentProbeTimeout = 2 * time.Second

var _ pipeline.Reachability = (*BatchPublisher)(nil)

// Reachable implements pipeline.Reachability: nil while the connection is
// up and the broker answers.
func (p *BatchPublisher) Reachable() error {
	switch {
	case p.isClosed():
		return pipeline.Infrastructure(errors.New("rabbit: publisher is closed"))
	case !p.connected():
		return pipeline.Infrastructure(errors.New("rabbit: not connected to RabbitMQ (reconnecting)"))
	case p.silent.Load():
		p.probe()
		return pipeline.Infrastructure(errors.New("rabbit: the broker stopped answering (no confirm or channel within the deadline); publishing waits until it answers again"))
	}
	return nil
}

// wentSilent marks the broker silent after a call that ctx's deadline cut
// short, and starts the probe that clears it.
func (p *BatchPublisher) wentSilent(ctx context.Context, err error) {
	if errors.Is(err, context.DeadlineExceeded) && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		p.silent.Store(true)
		p.probe()
	}
}

// probe opens a channel in the background, one probe at a time, until the
// broker answers (silent cleared) or the publisher closes.
func (p *BatchPublisher) probe() {
	if !p.probing.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer p.probing.Store(false)
		for p.silent.Load() && !p.isClosed() {
			if p.connected() {
				ctx, cancel := context.WithTimeout(context.Background(), silentProbeTimeout)
				ch, err := p.openChannel(ctx)
				cancel()
				if err == nil {
					closeAsync(ch)
					p.silent.Store(false)
					return
				}
			}
			time.Sleep(silentProbeTimeout / 4)
		}
	}()
}

// openChannel opens a confirm-mode channel, waiting at most until ctx
// ends: amqp091's Channel and Confirm wait for the broker's answer with no
// deadline, and behind a black hole it comes only when the heartbeat gives
// the connection up. A channel that opens after ctx ended is closed.
func (p *BatchPublisher) openChannel(ctx context.Context) (*amqp.Channel, error) {
	type opened struct {
		ch  *amqp.Channel
		err error
	}
	conn := p.conn.Connection()
	if conn == nil {
		return nil, errors.New("not connected")
	}
	done := make(chan opened, 1)
	go func() {
		ch, err := conn.Channel()
		if err != nil {
			done <- opened{err: fmt.Errorf("opening publish channel: %w", err)}
			return
		}
		if err := ch.Confirm(false); err != nil {
			closeAsync(ch)
			done <- opened{err: fmt.Errorf("enabling publisher confirms: %w", err)}
			return
		}
		done <- opened{ch: ch}
	}()
	select {
	case o := <-done:
		return o.ch, o.err
	case <-ctx.Done():
		go func() {
			if o := <-done; o.ch != nil {
				closeAsync(o.ch)
			}
		}()
		return nil, fmt.Errorf("opening publish channel: %w", ctx.Err())
	}
}

// closeAsync closes ch without waiting: Close waits for the broker's
// close-ok, which a silent broker never sends.
func closeAsync(ch *amqp.Channel) { go func() { _ = ch.Close() }() }

// NewBatchPublisher returns a publisher over conn (which it does not own).
func NewBatchPublisher(conn *wamqp.ConnectionWrapper, topo *Topology) (*BatchPublisher, error) {
	if conn == nil || topo == nil {
		return nil, errors.New("rabbit: NewBatchPublisher needs a connection and a topology")
	}
	n := topo.cfg.PublishChannels
	p := &BatchPublisher{
		conn: conn, topo: topo,
		channels: make(chan *amqp.Channel, n),
		slots:    make(chan struct{}, n),
		declared: map[string]bool{},
	}
	return p, nil
}

// OrderedTopics implements pipeline.Ordering: the relay takes its ordered
// topics from the topology this publisher routes by.
func (p *BatchPublisher) OrderedTopics() []string { return p.topo.OrderedTopics() }

// Publish implements message.Publisher: all of msgs, confirmed, or an error.
func (p *BatchPublisher) Publish(topic string, msgs ...*message.Message) error {
	batch := make([]Outgoing, len(msgs))
	for i, m := range msgs {
		batch[i] = Outgoing{Topic: topic, Msg: m}
	}
	ctx := context.Background()
	if len(msgs) > 0 {
		ctx = msgs[0].Context()
	}
	return errors.Join(p.PublishBatch(ctx, batch)...)
}

// PublishBatch publishes batch and returns one error per message, nil for
// each the broker confirmed. A message whose error is not nil may still
// have reached the broker (its confirm was lost with the connection):
// delivery is at least once.
//
// A broker closes a channel over one message (an exchange it refuses to
// declare, such as one in the reserved "amq." namespace, or a message it
// will not take), and every later message on that channel fails with it.
// So when the channel closed under a batch while the connection stayed up,
// the messages that failed are published again one by one, each on a
// channel of its own: only a message that closes a channel by itself is
// charged with the failure, and the rest are delivered.
func (p *BatchPublisher) PublishBatch(ctx context.Context, batch []Outgoing) []error {
	errs, channelClosed := p.publish(ctx, batch)
	if !channelClosed || len(batch) == 1 || !p.connected() {
		return errs
	}
	for i := range batch {
		if errs[i] != nil && ctx.Err() == nil {
			one, _ := p.publish(ctx, batch[i:i+1])
			errs[i] = one[0]
		}
	}
	return errs
}

// connected reports whether the connection is up. watermill-amqp's
// IsConnected reads a field that its reconnect loop writes without a lock
// (a data race whenever the connection drops, which -race reports); the
// amqp091 connection's own IsClosed is atomic.
func (p *BatchPublisher) connected() bool {
	c := p.conn.Connection()
	return c != nil && !c.IsClosed()
}

// outage marks err as the publisher's own (pipeline.Infrastructure) when
// the connection is down or the broker silent: the message is not at fault, and the relay
// leaves it to a relay that can reach the broker instead of spending an
// attempt and a backoff on it. A failure while connected (a nack, a
// channel a message closed) stays the message's.
func (p *BatchPublisher) outage(err error) error {
	if err == nil || p.connected() && !p.silent.Load() && !errors.Is(err, amqp.ErrClosed) {
		return err
	}
	return pipeline.Infrastructure(err)
}

// publish sends batch on one channel. channelClosed reports that the
// channel closed under it (not merely that a message was nacked).
func (p *BatchPublisher) publish(ctx context.Context, batch []Outgoing) (errs []error, channelClosed bool) {
	errs, channelClosed = p.publishOnce(ctx, batch)
	for i := range errs {
		errs[i] = p.outage(errs[i])
	}
	return errs, channelClosed
}

func (p *BatchPublisher) publishOnce(ctx context.Context, batch []Outgoing) (errs []error, channelClosed bool) {
	errs = make([]error, len(batch))
	if len(batch) == 0 {
		return errs, false
	}
	fail := func(err error) ([]error, bool) {
		for i := range errs {
			if errs[i] == nil {
				errs[i] = err
			}
		}
		return errs, channelClosed
	}
	ch, err := p.acquire(ctx)
	if err != nil {
		return fail(err)
	}
	healthy := true
	defer func() {
		if ch != nil {
			p.release(ch, healthy)
		}
	}()

	// Exchanges first: declaring one is a round trip, which must not wait
	// behind held writes. A topic the broker refuses closes the channel:
	// its messages are charged with that, and the rest go on a new one.
	exchanges := make([]string, len(batch))
	for i, o := range batch {
		if errs[i] != nil {
			continue
		}
		if exchanges[i], err = p.exchange(ch, p.topo.exchangeFor(o.Topic, o.Msg)); err != nil {
			if !ch.IsClosed() || !p.connected() {
				healthy = false
				return fail(err)
			}
			channelClosed = true
			for j := i; j < len(batch); j++ {
				if batch[j].Topic == o.Topic {
					errs[j] = err
				}
			}
			p.release(ch, false)
			if ch, err = p.acquire(ctx); err != nil {
				healthy = false
				ch = nil
				return fail(err)
			}
		}
	}
	if ch == nil {
		return errs, channelClosed
	}
	confirms := make([]*amqp.DeferredConfirmation, len(batch))
	release := HoldWrites(p.conn)
	for i, o := range batch {
		if errs[i] != nil {
			continue
		}
		pub, err := Marshaler{}.Marshal(o.Msg)
		if err != nil {
			errs[i] = fmt.Errorf("marshaling message %s: %w", o.Msg.UUID, err)
			continue
		}
		confirms[i], err = ch.PublishWithDeferredConfirmWithContext(ctx, exchanges[i], p.topo.RoutingKey(o.Topic, o.Msg), false, false, pub)
		if err != nil {
			healthy = false
			_ = release()
			channelClosed = channelClosed || ch.IsClosed()
			return fail(fmt.Errorf("publishing message %s to %s: %w", o.Msg.UUID, exchanges[i], err))
		}
	}
	if err := release(); err != nil {
		healthy = false
		return fail(pipeline.Infrastructure(fmt.Errorf("sending the batch: %w", err)))
	}
	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		ok, err := dc.WaitContext(ctx)
		switch {
		case err != nil:
			healthy = false // confirms of this channel are now out of step with us
			p.wentSilent(ctx, err)
			errs[i] = fmt.Errorf("waiting for confirm of message %s: %w", batch[i].Msg.UUID, err)
		case !ok:
			errs[i] = fmt.Errorf("broker did not confirm message %s (nack or channel closed)", batch[i].Msg.UUID)
		}
	}
	if ch.IsClosed() {
		healthy = false
		channelClosed = true
	}
	return errs, channelClosed
}

func (p *BatchPublisher) exchange(ch *amqp.Channel, name string) (string, error) {
	p.mu.Lock()
	done := p.declared[name]
	p.mu.Unlock()
	if done {
		return name, nil
	}
	if err := p.topo.ExchangeDeclare(ch, name, p.topo.PublisherConfig()); err != nil {
		return "", err
	}
	p.mu.Lock()
	p.declared[name] = true
	p.mu.Unlock()
	return name, nil
}

func (p *BatchPublisher) acquire(ctx context.Context) (*amqp.Channel, error) {
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	// Down or silent: at once, before a pooled channel would wait out
	// ctx's deadline on a broker that answers nothing.
	if err := p.Reachable(); err != nil {
		<-p.slots
		return nil, err
	}
	select {
	case ch := <-p.channels:
		if !ch.IsClosed() {
			return ch, nil
		}
	default:
	}
	// A channel that cannot be opened or put in confirm mode is the
	// connection's trouble, never a message's.
	ch, err := p.openChannel(ctx)
	if err != nil {
		p.wentSilent(ctx, err)
		<-p.slots
		return nil, pipeline.Infrastructure(err)
	}
	return ch, nil
}

func (p *BatchPublisher) release(ch *amqp.Channel, healthy bool) {
	defer func() { <-p.slots }()
	if !healthy || ch.IsClosed() || p.isClosed() {
		closeAsync(ch)
		return
	}
	select {
	case p.channels <- ch:
	default:
		closeAsync(ch)
	}
}

func (p *BatchPublisher) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// Close closes the idle channels; the connection belongs to the caller.
func (p *BatchPublisher) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	for {
		select {
		case ch := <-p.channels:
			_ = ch.Close()
		default:
			return nil
		}
	}
}
