package rabbit_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// orderedQueue declares, on a topology of the test's own, the one
// partition queue of handler "h" on ordered topic "t" (a quorum queue with
// a single active consumer, prefetch 1, as Ferry runs it) and queues n
// messages m1..mn on it.
func orderedQueue(t *testing.T, n int) (*rabbit.Topology, rabbit.Subscription, *amqp.Connection) {
	t.Helper()
	cfg := pipelinetest.Rabbit(t)
	cfg.OrderedTopics, cfg.Partitions = []string{"t"}, 1
	topo, err := rabbit.NewTopology(cfg)
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)
	conn, err := amqp.Dial(topo.Config().URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	require.NoError(t, topo.Declare(conn, rabbit.Binding{Topic: "t", Queue: "h"}))
	subs := topo.Subscriptions("h", "t")
	require.Len(t, subs, 1)
	require.True(t, subs[0].Ordered)
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	require.NoError(t, ch.Confirm(false))
	for i := 1; i <= n; i++ {
		p, err := rabbit.Marshaler{}.Marshal(message.NewMessage(fmt.Sprintf("m%d", i), []byte(`{}`)))
		require.NoError(t, err)
		dc, err := ch.PublishWithDeferredConfirm("", subs[0].Queue, true, false, p)
		require.NoError(t, err)
		ok, err := dc.WaitContext(context.Background())
		require.NoError(t, err)
		require.True(t, ok)
	}
	return topo, subs[0], conn
}

// rawConsumer consumes queue on a channel of its own with prefetch 1,
// as a partition's consumer does.
func rawConsumer(t *testing.T, conn *amqp.Connection, queue string) (*amqp.Channel, <-chan amqp.Delivery) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Qos(1, 0, false))
	d, err := ch.Consume(queue, "", false, false, false, false, nil)
	require.NoError(t, err)
	return ch, d
}

func next(t *testing.T, d <-chan amqp.Delivery) amqp.Delivery {
	t.Helper()
	select {
	case m := <-d:
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery within 10s")
		return amqp.Delivery{}
	}
}

// drainIDs reads n deliveries, acking each, and returns their ids.
func drainIDs(t *testing.T, d <-chan amqp.Delivery, n int) []string {
	t.Helper()
	var ids []string
	for range n {
		m := next(t, d)
		ids = append(ids, m.MessageId)
		require.NoError(t, m.Ack(false))
	}
	return ids
}

// The broker behaviour a consumer's stop relies on, measured on the
// RabbitMQ this machine runs, on a quorum queue with a single active
// consumer and prefetch 1 (an ordered partition): a channel that closes
// with its delivery unacked gives it back first in line, to the standby
// that takes over, and so does one that closes holding a delivery it never
// handed to a handler. A user on another broker version runs this test to
// check. What Ferry therefore never does is logged for the record: a nack
// with requeue, or a basic.cancel before the close, sends the head behind
// its successors on 3.10.
func TestBrokerReturnsAClosedChannelsDeliveryFirst(t *testing.T) {
	t.Parallel()
	t.Run("unacked head, standby takes over", func(t *testing.T) {
		t.Parallel()
		_, sub, conn := orderedQueue(t, 5)
		a, da := rawConsumer(t, conn, sub.Queue)
		require.Equal(t, "m1", next(t, da).MessageId)
		// B waits as the standby (single active consumer).
		b, db := rawConsumer(t, conn, sub.Queue)
		defer b.Close()
		require.NoError(t, a.Close())
		require.Equal(t, []string{"m1", "m2", "m3", "m4", "m5"}, drainIDs(t, db, 5))
	})
	t.Run("head acked, the next received and never handed out", func(t *testing.T) {
		t.Parallel()
		_, sub, conn := orderedQueue(t, 5)
		a, da := rawConsumer(t, conn, sub.Queue)
		m1 := next(t, da)
		require.NoError(t, m1.Ack(false))
		require.Equal(t, "m2", next(t, da).MessageId) // held, unacked
		require.NoError(t, a.Close())
		b, db := rawConsumer(t, conn, sub.Queue)
		defer b.Close()
		require.Equal(t, []string{"m2", "m3", "m4", "m5"}, drainIDs(t, db, 4))
	})
	t.Run("what Ferry avoids", func(t *testing.T) {
		t.Parallel()
		for _, how := range []string{"nack-requeue", "cancel"} {
			_, sub, conn := orderedQueue(t, 5)
			a, da := rawConsumer(t, conn, sub.Queue)
			m1 := next(t, da)
			b, db := rawConsumer(t, conn, sub.Queue) // the standby
			if how == "nack-requeue" {
				require.NoError(t, m1.Nack(false, true))
			} else {
				require.NoError(t, a.Cancel("", false))
				time.Sleep(100 * time.Millisecond)
			}
			require.NoError(t, a.Close())
			t.Logf("%s then close: the standby got %v", how, drainIDs(t, db, 5))
			_ = b.Close()
		}
	})
}

// A graceful stop drains: the handler holding a message finishes it (its
// context alive meanwhile), the ack is sent, and only then the channel
// closes; the delivery the consumer received meanwhile and never handed
// out goes back first in line. Nothing runs twice, nothing is reordered.
func TestConsumerDrainsOnStop(t *testing.T) {
	t.Parallel()
	topo, sub, conn := orderedQueue(t, 4)
	wconn, err := rabbit.Dial(topo.Config(), "ferry-drain-test", watermill.NopLogger{})
	require.NoError(t, err)
	defer wconn.Close()
	c, err := rabbit.NewConsumer(wconn, topo, sub, rabbit.ConsumerConfig{DrainTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out, err := c.Subscribe(ctx, "t")
	require.NoError(t, err)
	m1 := <-out
	require.Equal(t, "m1", m1.UUID)

	// The stop, as Watermill's router makes it: the subscription's context
	// ends and Close is called, while the handler still works.
	stopping := pipeline.Stopping(m1.Context())
	require.NotNil(t, stopping)
	closed := make(chan struct{})
	go func() { cancel(); _ = c.Close(); close(closed) }()
	select {
	case <-stopping:
	case <-time.After(5 * time.Second):
		t.Fatal("the message was not told of the stop")
	}
	time.Sleep(300 * time.Millisecond) // the handler's work, after the stop began
	require.NoError(t, m1.Context().Err(), "a draining consumer must not cut its handlers")
	select {
	case <-closed:
		t.Fatal("Close returned while a handler held a message")
	default:
	}
	require.True(t, m1.Ack())
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the last handler settled")
	}
	select {
	case m, ok := <-out:
		require.False(t, ok, "a draining consumer handed out %v", m)
	case <-time.After(5 * time.Second):
		t.Fatal("the subscription's channel did not close")
	}

	b, db := rawConsumer(t, conn, sub.Queue)
	defer b.Close()
	require.Equal(t, []string{"m2", "m3", "m4"}, drainIDs(t, db, 3), "m1 acked once, m2 back first")
}

// What an ordered partition's consumer cannot settle goes back first in
// line, never behind its successors: a nack (a handler stopped while it
// held the partition, a poison store or database it waited for) closes
// the channel instead of requeueing, and the consumer carries on from the
// same head. A stop that meets a handler only waiting (pipeline.Sleep)
// ends the wait at once instead of waiting for the drain's timeout.
func TestConsumerGivesAnOrderedHeadBackFirst(t *testing.T) {
	t.Parallel()
	topo, sub, _ := orderedQueue(t, 3)
	wconn, err := rabbit.Dial(topo.Config(), "ferry-headback-test", watermill.NopLogger{})
	require.NoError(t, err)
	defer wconn.Close()

	var got []string
	var mu sync.Mutex
	received := func(m *message.Message) {
		mu.Lock()
		got = append(got, m.UUID)
		mu.Unlock()
	}
	c, err := rabbit.NewConsumer(wconn, topo, sub, rabbit.ConsumerConfig{DrainTimeout: time.Minute}, watermill.NopLogger{})
	require.NoError(t, err)
	out, err := c.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := <-out
	received(m)
	m.Nack() // the first try fails and is not settled
	m = <-out
	received(m)
	require.Equal(t, []string{"m1", "m1"}, got, "the nacked head comes back before its successors")
	require.Equal(t, "1", m.Metadata.Get("x-delivery-count"), "given back to the queue, not held by the client")

	// Now the handler holds the partition, waiting for its retry: the stop
	// ends the wait, and the head goes back first.
	waited := make(chan error, 1)
	go func() { waited <- pipeline.Sleep(m.Context(), time.Hour) }()
	began := time.Now()
	go func() {
		err := <-waited
		if err != nil {
			m.Nack()
		}
		waited <- err
	}()
	require.NoError(t, c.Close())
	require.Less(t, time.Since(began), 10*time.Second, "the stop waited for a wait")
	require.ErrorIs(t, <-waited, pipeline.ErrStopping)
	require.ErrorIs(t, pipeline.ErrStopping, context.Canceled)

	rconn, err := amqp.Dial(topo.Config().URL)
	require.NoError(t, err)
	defer rconn.Close()
	b, db := rawConsumer(t, rconn, sub.Queue)
	defer b.Close()
	require.Equal(t, []string{"m1", "m2", "m3"}, drainIDs(t, db, 3))
}
