package pgcdc_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

const (
	orderedTopic = "cdc.ordered"
	handlerName  = "cdc-test"
)

// rig is one test's outbox schema, broker namespace (one queue, bound to
// the ordered topic, one partition so the queue's order is the publish
// order), slot and publication, all removed when the test ends.
type rig struct {
	schema, slot string
	amqpCfg      rabbit.Config
	topo         *rabbit.Topology
	conn         *amqp.Connection
	pool         *pgxpool.Pool
	queue        string

	mu  sync.Mutex
	got []delivery
}

func newRig(t *testing.T) *rig {
	t.Helper()
	r := &rig{schema: pipelinetest.Schema(t)}
	r.pool = pipelinetest.Pool(t, r.schema, "ferry-cdc-test")
	pipelinetest.RequireLogicalWAL(t)
	r.slot = "ferry_test_" + strings.TrimPrefix(r.schema, "ferry_test_")
	r.amqpCfg = pipelinetest.Rabbit(t)
	r.amqpCfg.OrderedTopics = []string{orderedTopic}
	r.amqpCfg.Partitions = 1
	var err error
	r.topo, err = rabbit.NewTopology(r.amqpCfg)
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, r.topo)
	r.conn, err = amqp.Dial(r.amqpCfg.URL)
	require.NoError(t, err)
	t.Cleanup(func() { r.conn.Close() })
	require.NoError(t, r.topo.Declare(r.conn, rabbit.Binding{Topic: orderedTopic, Queue: handlerName}))
	r.queue = r.topo.Subscriptions(handlerName, orderedTopic)[0].Queue
	r.consume(t)
	// Registered before any streamer starts, so it runs after they stop.
	t.Cleanup(func() { dropSlot(t, r.pool, r.slot) })
	return r
}

// dropSlot removes the test's slot and publication, waiting for a
// walsender that is still going away.
func dropSlot(t *testing.T, pool *pgxpool.Pool, slot string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, _, err := pgcdc.DropWhenInactive(ctx, pool, slot, slot); err != nil {
		t.Errorf("dropping replication slot %s: %v", slot, err)
	}
}

func (r *rig) cdcConfig() pgcdc.Config {
	return pgcdc.Config{Slot: r.slot, StatusInterval: time.Second, HeartbeatInterval: 500 * time.Millisecond, StandbyRetry: 200 * time.Millisecond}
}

// relay is a relay publishing to the rig's broker with Ferry's batch
// publisher over its own reconnecting connection (amqpURL: the rig's
// broker unless a proxy's address is given).
func (r *rig) relay(t *testing.T, pool *pgxpool.Pool, amqpURL string, cfg pgoutbox.RelayConfig) *pgoutbox.Relay {
	t.Helper()
	c := r.amqpCfg
	if amqpURL != "" {
		c.URL = amqpURL
	}
	topo, err := rabbit.NewTopology(c)
	require.NoError(t, err)
	conn, err := rabbit.Dial(c, "ferry-cdc-test", watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	pub, err := rabbit.NewBatchPublisher(conn, topo)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	cfg.OrderedTopics = pub.OrderedTopics()
	if cfg.Table == (pgoutbox.Table{}) {
		cfg.Table = testTable
	}
	relay, err := pgoutbox.NewRelay(pool, pub, cfg, testLogger(t))
	require.NoError(t, err)
	return relay
}

// start runs a streamer until the test ends (or stop is called).
func (r *rig) start(t *testing.T, pool *pgxpool.Pool, relay pgcdc.IDRelay, cfg pgcdc.Config) (s *pgcdc.Streamer, stop func()) {
	t.Helper()
	s, err := pgcdc.NewStreamer(pool, relay, testTable, cfg, testLogger(t))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("streamer did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return s, stop
}

// insert writes n outbox rows in transactions of txSize, event i on
// aggregate agg-(i % aggregates) with payload {"seq": i}, seq counting on
// from first.
func (r *rig) insert(t *testing.T, first, n, aggregates, txSize int) {
	t.Helper()
	ctx := context.Background()
	for start := first; start < first+n; start += txSize {
		end := min(first+n, start+txSize)
		_, err := r.pool.Exec(ctx, `
			INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, payload_raw, message_uuid)
			SELECT 'agg-' || (i % $3), $4, jsonb_build_object('seq', i), convert_to(jsonb_build_object('seq', i)::text, 'UTF8'), 'cdc-' || i
			FROM generate_series($1::int, $2::int - 1) AS i`, start, end, aggregates, orderedTopic)
		require.NoError(t, err)
	}
}

type delivery struct {
	UUID, Aggregate string
	Seq             int
}

// consume starts the rig's one consumer (the partition queue allows a
// single active consumer), which keeps every delivery in queue order.
func (r *rig) consume(t *testing.T) {
	t.Helper()
	ch, err := r.conn.Channel()
	require.NoError(t, err)
	t.Cleanup(func() { ch.Close() })
	deliveries, err := ch.Consume(r.queue, "", true, false, false, false, nil)
	require.NoError(t, err)
	go func() {
		for d := range deliveries {
			msg, err := rabbit.Marshaler{}.Unmarshal(d)
			if err != nil {
				panic(err)
			}
			var p struct{ Seq int }
			_ = json.Unmarshal(msg.Payload, &p)
			r.mu.Lock()
			r.got = append(r.got, delivery{UUID: msg.UUID, Aggregate: msg.Metadata.Get(pipeline.MetaAggregateID), Seq: p.Seq})
			r.mu.Unlock()
		}
	}()
}

// drain takes what the consumer received since the last drain.
func (r *rig) drain(t *testing.T) []delivery {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.got
	r.got = nil
	return out
}

// collect drains the queue until want distinct messages arrived.
func (r *rig) collect(t *testing.T, want int, timeout time.Duration) []delivery {
	t.Helper()
	var all []delivery
	seen := map[string]bool{}
	deadline := time.Now().Add(timeout)
	for {
		for _, d := range r.drain(t) {
			all = append(all, d)
			seen[d.UUID] = true
		}
		if len(seen) >= want {
			return all
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %d distinct message(s) of %d arrived", timeout, len(seen), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// requireInOrder checks that every event arrived and that, per aggregate,
// first deliveries come in seq order; a duplicate must be a redelivery of
// one already seen (what the consumers' ledger absorbs).
func requireInOrder(t *testing.T, got []delivery, first, n int) (duplicates int) {
	t.Helper()
	last := map[string]int{}
	seen := map[string]bool{}
	for _, d := range got {
		if seen[d.UUID] {
			duplicates++
			continue
		}
		seen[d.UUID] = true
		if prev, ok := last[d.Aggregate]; ok && d.Seq < prev {
			t.Fatalf("aggregate %s: seq %d arrived after %d", d.Aggregate, d.Seq, prev)
		}
		last[d.Aggregate] = d.Seq
	}
	for i := first; i < first+n; i++ {
		if !seen[fmt.Sprintf("cdc-%d", i)] {
			t.Fatalf("event cdc-%d never arrived (lost)", i)
		}
	}
	require.Len(t, seen, n)
	return duplicates
}

func (r *rig) pending(t *testing.T) int {
	t.Helper()
	n, err := testTable.PendingCount(context.Background(), r.pool)
	require.NoError(t, err)
	return int(n)
}

func (r *rig) awaitPending(t *testing.T, want int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		n := r.pending(t)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %d outbox row(s) pending, want %d", timeout, n, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *rig) slotStatus(t *testing.T) pgcdc.SlotStatus {
	t.Helper()
	st, err := pgcdc.ReadSlot(context.Background(), r.pool, r.slot)
	require.NoError(t, err)
	return st
}

func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("FERRY_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// poolWith opens a pool on the rig's schema with extra session settings.
func (r *rig) poolWith(t *testing.T, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pipelinetest.DatabaseURL())
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = `"` + r.schema + `"`
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}
