package rabbit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A consumer whose process steps aside (its database out of reach:
// ConsumerConfig.StepAside) while its handler is stuck does not wait for
// the handler: past the grace its channel closes, the stuck handler's
// context ends, and the delivery, with the rest of the ordered partition,
// goes to the other process's consumer, which handles them in order. With
// the consumer waiting for its handlers, as a pause does, the partition
// would stay with the stuck process.
func TestAStepAsideHandsAStuckPartitionOver(t *testing.T) {
	cfg := pipelinetest.Rabbit(t)
	cfg.OrderedTopics, cfg.Partitions = []string{"t"}, 1
	topo, err := rabbit.NewTopology(cfg)
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)
	conn, err := amqp.Dial(cfg.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	require.NoError(t, topo.Declare(conn, rabbit.Binding{Topic: "t", Queue: "h"}))
	subs := topo.Subscriptions("h", "t")
	require.Len(t, subs, 1)

	var (
		mu      sync.Mutex
		handled = map[string][]string{}
		aside   atomic.Bool
		stuck   = make(chan struct{})
		freed   = make(chan error, 1)
	)
	// Two processes, A then B: A's consumer registers first, the active
	// one (the broker counts only the active one of a single active
	// consumer queue).
	for _, proc := range []string{"A", "B"} {
		wconn, err := rabbit.Dial(cfg, "ferry-step-aside-"+proc, watermill.NopLogger{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = wconn.Close() })
		ccfg := rabbit.ConsumerConfig{InFlight: 1, DrainTimeout: 5 * time.Second, PausePoll: 100 * time.Millisecond, StepAsideGrace: 500 * time.Millisecond}
		if proc == "A" {
			ccfg.StepAside = aside.Load
		}
		c, err := rabbit.NewConsumer(wconn, topo, subs[0], ccfg, watermill.NopLogger{})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddConsumerHandler("h-"+proc, "t", c, func(msg *message.Message) error {
			mu.Lock()
			handled[proc] = append(handled[proc], msg.UUID)
			first := proc == "A" && len(handled[proc]) == 1
			mu.Unlock()
			if first {
				// Stuck as on a dead database link, until the context ends.
				close(stuck)
				<-msg.Context().Done()
				freed <- msg.Context().Err()
				return msg.Context().Err()
			}
			return nil
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = router.Run(ctx); close(done) }()
		<-router.Running()
		t.Cleanup(func() { cancel(); <-done })
		if proc == "A" {
			require.Eventually(t, func() bool { return consumersOf(t, conn, subs[0].Queue) == 1 }, 10*time.Second, 20*time.Millisecond, "queue %s: %d consumers", subs[0].Queue, consumersOf(t, conn, subs[0].Queue))
		}
	}

	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	for i := 1; i <= 3; i++ {
		p, err := rabbit.Marshaler{}.Marshal(message.NewMessage(fmt.Sprintf("m%d", i), []byte(`{}`)))
		require.NoError(t, err)
		dc, err := ch.PublishWithDeferredConfirm("", subs[0].Queue, true, false, p)
		require.NoError(t, err)
		ok, err := dc.WaitContext(context.Background())
		require.NoError(t, err)
		require.True(t, ok)
	}
	select {
	case <-stuck:
	case <-time.After(10 * time.Second):
		t.Fatal("the active consumer (A) never took the first message")
	}
	aside.Store(true)
	start := time.Now()
	select {
	case err := <-freed:
		require.True(t, errors.Is(err, context.Canceled), "%v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the stuck handler's context never ended: the step aside waited for it")
	}
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled["B"]) == 3
	}, 10*time.Second, 20*time.Millisecond, "B never got the partition")
	t.Logf("the partition reached B %s after the step aside", time.Since(start).Round(time.Millisecond))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"m1", "m2", "m3"}, handled["B"], "in order, the stuck one first")
	require.Equal(t, []string{"m1"}, handled["A"])
}

// consumersOf is the number of consumers the broker counts on queue.
func consumersOf(t *testing.T, conn *amqp.Connection, queue string) int {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return -1
	}
	return q.Consumers
}
