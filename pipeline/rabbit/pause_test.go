package rabbit_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// switchSource is an operator's pause, as pgpause.Source reports it, for
// route "h" and "u" at once.
type switchSource struct{ on atomic.Bool }

func (s *switchSource) Paused(context.Context) (map[string]bool, error) {
	return map[string]bool{"h": s.on.Load(), "u": s.on.Load()}, nil
}

// pausedRoutes runs an ordered route "h" (one partition of topic "t") and
// an unordered route "u" (topic "v") on node through the
// pause link and consumers that ask the same PauseWatch (or, with detach
// false, consumers that do not: Ferry before 2026-12-07), each with 5
// messages queued. The handlers pause both routes when they take their
// first message, then finish it. It returns the source, the handled ids
// in order per route, and the consumers' captured logs.
func pausedRoutes(t *testing.T, node *pipelinetest.RabbitNode, ns string, detach bool) (*switchSource, func() map[string][]string, *errorLog, func()) {
	t.Helper()
	cfg := node.Config
	cfg.Namespace = ns
	cfg.OrderedTopics, cfg.Partitions, cfg.Consumers = []string{"t"}, 1, 1
	topo, err := rabbit.NewTopology(cfg)
	require.NoError(t, err)
	conn, err := amqp.Dial(cfg.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	require.NoError(t, topo.Declare(conn, rabbit.Binding{Topic: "t", Queue: "h"}, rabbit.Binding{Topic: "v", Queue: "u"}))
	subs := append(topo.Subscriptions("h", "t"), topo.Subscriptions("u", "v")...)
	require.Len(t, subs, 2)
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	for _, s := range subs {
		for i := 1; i <= 5; i++ {
			p, err := rabbit.Marshaler{}.Marshal(message.NewMessage(fmt.Sprintf("%s-m%d", s.Name, i), []byte(`{}`)))
			require.NoError(t, err)
			dc, err := ch.PublishWithDeferredConfirm("", s.Queue, true, false, p)
			require.NoError(t, err)
			ok, err := dc.WaitContext(context.Background())
			require.NoError(t, err)
			require.True(t, ok)
		}
	}
	_ = ch.Close()

	src := &switchSource{}
	logs := &errorLog{}
	watch, err := middleware.NewPauseWatch(src, 100*time.Millisecond, nil)
	require.NoError(t, err)
	pause, err := middleware.PauseConfig{Watch: watch}.Middleware(nil)
	require.NoError(t, err)
	wconn, err := rabbit.Dial(cfg, "ferry-pause-test", logs)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var mu sync.Mutex
	handled := map[string][]string{}
	for _, s := range subs {
		ccfg := rabbit.ConsumerConfig{InFlight: 1, DrainTimeout: 5 * time.Second}
		if detach {
			route := pipeline.RouteName(s.Name)
			ccfg.Paused = func() bool { return watch.Paused(context.Background(), route) }
			ccfg.PausePoll = watch.Poll()
		}
		c, err := rabbit.NewConsumer(wconn, topo, s, ccfg, logs)
		require.NoError(t, err)
		topic := map[bool]string{true: "t", false: "v"}[s.Ordered]
		name := s.Name
		h := router.AddConsumerHandler(name, topic, c, func(msg *message.Message) error {
			mu.Lock()
			first := len(handled[name]) == 0
			handled[name] = append(handled[name], msg.UUID)
			mu.Unlock()
			if first {
				src.on.Store(true) // the operator pauses while it works
				time.Sleep(300 * time.Millisecond)
			}
			return nil
		})
		h.AddMiddleware(pause)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = router.Run(ctx); close(done) }()
	<-router.Running()
	stop := func() {
		cancel()
		<-done
		_ = wconn.Close()
	}
	t.Cleanup(stop)
	return src, func() map[string][]string {
		mu.Lock()
		defer mu.Unlock()
		out := map[string][]string{}
		for k, v := range handled {
			out[k] = append([]string(nil), v...)
		}
		return out
	}, logs, stop
}

// queueState is what the broker says of the queues in namespace ns:
// messages unacknowledged and consumers, by queue name.
func queueState(t *testing.T, node *pipelinetest.RabbitNode, ns string) map[string][2]string {
	t.Helper()
	out := map[string][2]string{}
	lines := node.Output(t, "list_queues", "-q", "--no-table-headers", "name", "messages_unacknowledged", "consumers")
	for _, l := range strings.Split(strings.TrimSpace(lines), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 && strings.HasPrefix(f[0], ns) {
			out[strings.TrimPrefix(f[0], ns)] = [2]string{f[1], f[2]}
		}
	}
	return out
}

// A pause longer than the broker's consumer_timeout, on a RabbitMQ node of
// the test's own with the timeout lowered to 2 s (RabbitMQ checks it once
// a minute: the paused delivery below was timed out 60 s after the
// pause): the paused routes' consumers detach within a poll, so the broker
// holds their messages with none unacknowledged and has nothing to time
// out; for 65 s no channel is closed by the broker, nothing is handed to a
// handler twice, and after the resume every message is handled once, the
// ordered route's in order.
// Without detaching (Ferry before 2026-12-07) the same pause held a
// delivery unacked in the pause link until the broker closed its channel
// (PRECONDITION_FAILED), and redelivered it; that is measured too, as the
// broker behaviour the fix exists for.
func TestAPauseOutlastsTheBrokersConsumerTimeout(t *testing.T) {
	if _, err := exec.LookPath("rabbitmq-server"); err != nil && testing.Short() {
		t.Skip("needs a RabbitMQ node of its own")
	}
	node := pipelinetest.OwnRabbit(t)
	node.Ctl(t, "eval", "application:set_env(rabbit, consumer_timeout, 2000).")

	t.Run("consumers detach", func(t *testing.T) {
		t.Parallel()
		ns := node.Config.Namespace + "detach."
		src, handled, logs, _ := pausedRoutes(t, node, ns, true)
		require.Eventually(t, func() bool { return src.on.Load() }, 10*time.Second, 20*time.Millisecond)
		// Both routes took one message each before the pause; then nothing.
		require.Eventually(t, func() bool {
			st := queueState(t, node, ns)
			return st["h@0"] == [2]string{"0", "0"} && st["u"] == [2]string{"0", "0"}
		}, 10*time.Second, 100*time.Millisecond, "a paused route's consumers hold deliveries or stay attached: %v", queueState(t, node, ns))
		// Well past the timeout and the broker's checks of it.
		deadline := time.Now().Add(65 * time.Second)
		for time.Now().Before(deadline) {
			st := queueState(t, node, ns)
			require.Equal(t, [2]string{"0", "0"}, st["h@0"], "ordered route during the pause")
			require.Equal(t, [2]string{"0", "0"}, st["u"], "unordered route during the pause")
			time.Sleep(2 * time.Second)
		}
		require.Equal(t, map[string][]string{"h@0": {"h@0-m1"}, "u": {"u-m1"}}, handled())
		src.on.Store(false)
		require.Eventually(t, func() bool {
			h := handled()
			return len(h["h@0"]) == 5 && len(h["u"]) == 5
		}, 20*time.Second, 50*time.Millisecond, "not every message was handled after the resume: %v", handled())
		time.Sleep(time.Second)
		h := handled()
		require.Equal(t, []string{"h@0-m1", "h@0-m2", "h@0-m3", "h@0-m4", "h@0-m5"}, h["h@0"], "the ordered route, once each, in order")
		require.ElementsMatch(t, []string{"u-m1", "u-m2", "u-m3", "u-m4", "u-m5"}, h["u"], "the unordered route, once each")
		require.False(t, logs.has("PRECONDITION_FAILED"), "the broker closed a channel: %v", logs.all())
		st := queueState(t, node, ns)
		require.Equal(t, "0", st["h@0"][0])
		require.Equal(t, "0", st["u"][0])
	})

	t.Run("consumers stay attached (before)", func(t *testing.T) {
		t.Parallel()
		ns := node.Config.Namespace + "attached."
		src, _, logs, stop := pausedRoutes(t, node, ns, false)
		require.Eventually(t, func() bool { return src.on.Load() }, 10*time.Second, 20*time.Millisecond)
		start := time.Now()
		timedOut := func() bool { return logs.has("PRECONDITION_FAILED") }
		require.Eventually(t, timedOut, 2*time.Minute, 200*time.Millisecond, "the broker never timed out a paused delivery: was consumer_timeout lowered?")
		t.Logf("the broker closed a channel holding a paused delivery %s after the pause (consumer_timeout 2s)", time.Since(start).Round(time.Second))
		stop()
	})
}

// errorLog keeps the consumers' ERROR lines, read while they log
// (watermill's CaptureLoggerAdapter hands out its map unlocked).
type errorLog struct {
	mu     sync.Mutex
	errors []string
}

func (l *errorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, msg+": "+fmt.Sprint(err))
}
func (l *errorLog) Info(string, watermill.LogFields)                 {}
func (l *errorLog) Debug(string, watermill.LogFields)                {}
func (l *errorLog) Trace(string, watermill.LogFields)                {}
func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errorLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errors...)
}

func (l *errorLog) has(text string) bool {
	for _, e := range l.all() {
		if strings.Contains(e, text) {
			return true
		}
	}
	return false
}
