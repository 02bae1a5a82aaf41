package ordersapp_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// flaky fails a random share of publishes before they reach the broker.
type flaky struct {
	inner pipeline.BatchPublisher
	mu    sync.Mutex
	rng   *rand.Rand
	share float64
	fails int
}

// OrderedTopics passes the topology's ordered topics on to the relay.
func (f *flaky) OrderedTopics() []string { return f.inner.(pipeline.Ordering).OrderedTopics() }

func (f *flaky) PublishBatch(ctx context.Context, batch []pipeline.Outgoing) []error {
	errs := make([]error, len(batch))
	var pass []pipeline.Outgoing
	var idx []int
	f.mu.Lock()
	for i, o := range batch {
		if f.rng.Float64() < f.share {
			errs[i] = errors.New("injected publish failure")
			f.fails++
			continue
		}
		pass = append(pass, o)
		idx = append(idx, i)
	}
	f.mu.Unlock()
	for j, err := range f.inner.PublishBatch(ctx, pass) {
		errs[idx[j]] = err
	}
	return errs
}

func (f *flaky) Publish(string, ...*message.Message) error { return errors.New("flaky: batch only") }
func (f *flaky) Close() error                              { return nil }

type ledgerEntry struct {
	Aggregate string `json:"aggregate"`
	Seq       int    `json:"seq"`
}

// Three relays, one of them restarted half-way, relay 10,000 events of an
// ordered topic over 200 aggregates while 5% of publishes fail; the
// consumer must see every event, each aggregate's in sequence.
func TestOrderedTopicKeepsPerAggregateOrderAcrossRelaysFailuresAndRestarts(t *testing.T) {
	t.Parallel()
	const (
		events     = 10_000
		aggregates = 200
		topic      = "ledger.entry"
	)
	var (
		mu         sync.Mutex
		next       = map[string]int{}
		violations []string
		seen       int
	)
	cfg, provider, sink := testConfig(t)
	cfg.DatabaseMaxConns = 24
	h := startWith(t, cfg, provider, sink, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{
			Name: "ledger.check", Topic: topic, Ordered: true,
			Handler: handlers.Typed(func(ctx context.Context, e *ledgerEntry) error {
				mu.Lock()
				defer mu.Unlock()
				if e.Seq != next[e.Aggregate] {
					violations = append(violations, fmt.Sprintf("%s: got seq %d, want %d", e.Aggregate, e.Seq, next[e.Aggregate]))
				}
				next[e.Aggregate] = e.Seq + 1
				seen++
				return nil
			}),
		}}, nil
	}}, app.Components{Consumers: true})
	require.Equal(t, []string{topic}, h.app.OrderedTopics())

	// Seed in chunks, round-robin over the aggregates, so every batch mixes many.
	seq := map[string]int{}
	for start := 0; start < events; start += 1000 {
		tx, err := h.app.DB().BeginTx(context.Background(), nil)
		require.NoError(t, err)
		for i := start; i < start+1000; i++ {
			agg := fmt.Sprintf("acct-%03d", i%aggregates)
			msg, err := pipeline.NewEvent(context.Background(), agg, ledgerEntry{Aggregate: agg, Seq: seq[agg]})
			require.NoError(t, err)
			seq[agg]++
			require.NoError(t, h.app.Outbox().PublishTx(context.Background(), tx, topic, msg))
		}
		require.NoError(t, tx.Commit())
	}

	pub := &flaky{inner: h.app.BatchPublisher(), rng: rand.New(rand.NewPCG(1, 2)), share: 0.05}
	// Each relay with two batches in flight: they claim like separate
	// relays, and order must hold all the same.
	relayCfg := pgoutbox.RelayConfig{
		BatchSize: 100, PollInterval: 20 * time.Millisecond, InFlight: 2,
		Backoff:       pipeline.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond},
		OrderedTopics: h.app.OrderedTopics(),
	}
	newRelay := func() *pgoutbox.Relay {
		r, err := pgoutbox.NewRelay(h.app.Pool(), pub, relayCfg, nil)
		require.NoError(t, err)
		return r
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	firstCtx, stopFirst := context.WithCancel(ctx)
	wg.Go(func() { _ = newRelay().Run(firstCtx) })
	for range 2 {
		wg.Go(func() { _ = newRelay().Run(ctx) })
	}
	// Restart one relay once a third has been consumed.
	eventually(t, "a third of the events", func() bool { mu.Lock(); defer mu.Unlock(); return seen >= events/3 })
	stopFirst()
	wg.Go(func() { _ = newRelay().Run(ctx) })

	pipelinetest.RequireDrained(t, h.app.Pool(), 3*time.Minute)
	// 5 minutes: a full CI run's load once kept this consumer past 2
	// minutes after the outbox had drained (alone: 28 s for the whole test).
	lastLog := time.Now()
	eventuallyWithin(t, "every event consumed", 5*time.Minute, func() bool {
		mu.Lock()
		defer mu.Unlock()
		if seen < events && time.Since(lastLog) > 15*time.Second {
			t.Logf("consumed %d of %d so far", seen, events)
			lastLog = time.Now()
		}
		return seen >= events
	})
	cancel()
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, violations, "per-aggregate order broken")
	require.Equal(t, events, seen, "lost or duplicated events")
	for agg, n := range seq {
		require.Equal(t, n, next[agg], agg)
	}
	pub.mu.Lock()
	require.Greater(t, pub.fails, 100, "the failure injection must have bitten")
	pub.mu.Unlock()
	retried := 0
	for _, r := range h.outboxRows(t, pgoutbox.RowFilter{}) {
		if r.Attempts > 1 {
			retried++
		}
	}
	require.Positive(t, retried)
	t.Logf("%d events, %d injected failures, %d rows needed more than one attempt, %d duplicates suppressed",
		seen, pub.fails, retried, h.app.Stats().Duplicates)
}
