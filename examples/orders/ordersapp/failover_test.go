package ordersapp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A database failover under load, with synchronous replication: the
// primary crashes (pg_ctl stop -m immediate) while orders are taken,
// relayed and handled; the standby is promoted. Every connection Ferry
// holds — the pool, the relay's listener, the waker, the consumers'
// ledger transactions — reconnects through FERRY_DATABASE_URL's host list
// (target_session_attrs=read-write) to the new primary. Every order whose
// commit was acknowledged has its effect exactly once; nothing is
// poisoned (the outage is waited out, not blamed on the messages).
func TestDatabaseFailoverLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	r := failover(t, true, app.RelayModeNotify)
	require.Zero(t, r.lostAcked, "an acknowledged order lost its effect (synchronous replication keeps every acknowledged commit)")
	require.Zero(t, r.effectsOfLost)
}

// With asynchronous replication a failover may lose the last commits the
// standby had not received. What it keeps is consistent: no order without
// its event, no event without its order, each surviving order's effect
// once. An effect performed (outside the database) for an event the new
// primary no longer has is counted: the provider's idempotency key (the
// message id) is what protects it then, not the outbox.
func TestAsyncFailoverKeepsOrdersAndEventsTogether(t *testing.T) {
	t.Parallel()
	r := failover(t, false, app.RelayModeNotify)
	t.Logf("asynchronous replication: %d acknowledged orders lost, %d external effects performed for orders the new primary does not have, %d external calls repeated", r.lostAcked, r.effectsOfLost, r.externalRepeats)
}

// The CDC relay after a failover: PostgreSQL 15 keeps no replication slot
// on a standby, so the new primary has none. The streamer creates a new
// slot there, starting at its own position; what committed between the
// old slot's last confirmed position and the new slot's start is relayed
// by the polling safety net. No row is skipped, none is done twice.
// (PostgreSQL 17's failover slots keep the slot on the standby instead.)
func TestCDCRelayFailoverSkipsNoRow(t *testing.T) {
	t.Parallel()
	r := failover(t, true, app.RelayModeCDC)
	require.Zero(t, r.lostAcked, "an acknowledged order lost its effect")
}

type failoverResult struct {
	lostAcked     int // acknowledged orders the new primary does not have
	effectsOfLost int // external effects performed for orders the new primary does not have
	// externalRepeats are orders whose external effect ran more than once:
	// a ledger commit the crash cut after the call (the redelivery calls
	// again), which the provider's idempotency key absorbs.
	externalRepeats int
}

// failover runs orders through the pipeline on a primary and a standby of
// the test's own, crashes the primary, promotes the standby, and checks on
// the new primary: orders and events together, each surviving order's
// effect once, nothing poisoned.
func failover(t *testing.T, synchronous bool, relayMode string) failoverResult {
	ctx := context.Background()
	primary := pipelinetest.OwnPostgres(t)
	standby, err := primary.StartStandby(ctx, synchronous)
	require.NoError(t, err)
	t.Cleanup(func() { _ = standby.Stop() })
	require.NoError(t, primary.Exec(ctx, "postgres", `CREATE TABLE ha_orders (id bigint PRIMARY KEY);
		CREATE TABLE ha_effects (order_id bigint NOT NULL, at timestamptz NOT NULL DEFAULT now())`))

	// What the handler did outside the database (a provider's call), by order.
	var externalMu sync.Mutex
	external := map[int64]int{}
	a := startHA(t, primary, standby, func(cfg *app.Config) {
		cfg.Retry.MaxRetries = 3
		cfg.RelayMode = relayMode
		if relayMode == app.RelayModeCDC {
			cfg.CDCSafetyNetInterval, cfg.CDCSafetyNetMinAge = 500*time.Millisecond, 2*time.Second
		}
	}, func(id int64) {
		externalMu.Lock()
		external[id]++
		externalMu.Unlock()
	})

	// The producer: an order and its event per transaction, 200/s; an
	// order counts once its commit was acknowledged.
	var acked sync.Map // id → when its commit was acknowledged
	var next, failures atomic.Int64
	var lastRefusal atomic.Value // the last refused commit's error, for a failure's message
	var lastAck time.Time
	var longestGap time.Duration // the producers' pause: the longest time without an acknowledged commit
	produce := func(done <-chan struct{}) {
		for {
			select {
			case <-done:
				return
			default:
			}
			id := next.Add(1)
			err := a.Outbox().InTx(ctx, a.Pool(), func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
				if _, err := q.Exec(ctx, `INSERT INTO ha_orders (id) VALUES ($1)`, id); err != nil {
					return err
				}
				evt, err := pipeline.NewEvent(ctx, strconv.FormatInt(id, 10), map[string]int64{"id": id})
				if err != nil {
					return err
				}
				return p.PublishEvents(ctx, pipeline.Outgoing{Topic: "ha.order", Msg: evt})
			})
			if err != nil {
				failures.Add(1)
				lastRefusal.Store(err.Error())
			} else {
				acked.Store(id, time.Now())
				if !lastAck.IsZero() {
					longestGap = max(longestGap, time.Since(lastAck))
				}
				lastAck = time.Now()
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	var wg sync.WaitGroup
	// Orders for 3 s, the crash and the promotion, and orders for 5 s
	// after the promotion: timed from the promotion, since a busy machine
	// can take seconds to stop one server and promote the other.
	stopProducing := make(chan struct{})
	stopOnce := sync.OnceFunc(func() { close(stopProducing) })
	defer stopOnce()
	wg.Go(func() { produce(stopProducing) })
	time.Sleep(3 * time.Second)
	crashed := time.Now()
	require.NoError(t, primary.Halt())
	require.NoError(t, standby.Promote(ctx))
	promoted := time.Since(crashed)
	time.Sleep(5 * time.Second)
	stopOnce()
	wg.Wait()

	// Orders were taken before the crash and again after the promotion:
	// a Ferry that never reconnected would have none after (counted by
	// when each commit was acknowledged, not by a total that the orders
	// before the crash alone can reach on a busy machine).
	count, before, after := 0, 0, 0
	back := crashed.Add(promoted)
	acked.Range(func(_, v any) bool {
		count++
		switch at := v.(time.Time); {
		case at.Before(crashed):
			before++
		case at.After(back):
			after++
		}
		return true
	})
	require.Positive(t, before, "orders were taken before the crash")
	require.GreaterOrEqual(t, after, 20, "orders were taken again after the promotion, %s after the crash (%d refused meanwhile; the last refusal: %v)", promoted, failures.Load(), lastRefusal.Load())
	conn, err := pgx.Connect(ctx, standby.URL("postgres"))
	require.NoError(t, err)
	defer conn.Close(ctx)
	var effects, distinct int
	missingOrders := func() ([]int64, error) {
		rows, err := conn.Query(ctx, `SELECT o.id FROM ha_orders o LEFT JOIN ha_effects e ON e.order_id = o.id WHERE e.order_id IS NULL ORDER BY o.id`)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if !assert.Eventually(t, func() bool {
		missing, err := missingOrders()
		return err == nil && len(missing) == 0
	}, 90*time.Second, 250*time.Millisecond, "every order on the new primary gets its effect") {
		// Say where each missing order's event stands, so a failure tells
		// a lost ledger commit from an event never relayed.
		missing, err := missingOrders()
		require.NoError(t, err)
		for _, id := range missing {
			var row pgoutbox.Row
			var ledger int
			if rows, _ := (pgoutbox.Table{}).Rows(ctx, conn, pgoutbox.RowFilter{Topic: "ha.order", AggregateID: strconv.Itoa(int(id))}); len(rows) == 1 {
				row = rows[0]
				handled, _ := pgledger.HandledOf(ctx, conn, []string{row.MessageID}, nil)
				ledger = len(handled)
			}
			externalMu.Lock()
			calls := external[id]
			externalMu.Unlock()
			ackedAt, _ := acked.Load(id)
			t.Logf("order %d: acknowledged %v (crash %s, back %s); outbox row dispatched %v attempts %d last_error %q; ledger rows %d; external calls %d",
				id, ackedAt, crashed.Format(time.RFC3339Nano), back.Format(time.RFC3339Nano), row.Dispatched, row.Attempts, row.LastError, ledger, calls)
		}
		t.FailNow()
	}
	// The relay saw the promotion (a new timeline) and sent again what was
	// dispatched just before it: the effects a lost ledger commit took
	// with it run again, the others are dropped by the ledger.
	tl, err := pgoutbox.Table{}.Timeline(ctx, conn)
	require.NoError(t, err)
	timeline, replayedFrom, replayedRows := tl.Timeline, tl.ReplayedFrom, tl.ReplayedRows
	require.NotNil(t, replayedFrom, "the relay replayed after the promotion")
	require.Greater(t, timeline, *replayedFrom)
	require.Positive(t, *replayedRows)
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM ha_effects`).Scan(&effects, &distinct))
	require.Equal(t, distinct, effects, "no effect twice")
	// Consistent whatever was lost: an order and its event together.
	events, err := pgoutbox.Table{}.Rows(ctx, conn, pgoutbox.RowFilter{Topic: "ha.order"})
	require.NoError(t, err)
	evented := map[string]bool{}
	for _, e := range events {
		evented[e.AggregateID] = true
	}
	orderRows, err := conn.Query(ctx, `SELECT id::text FROM ha_orders`)
	require.NoError(t, err)
	orderIDs, err := pgx.CollectRows(orderRows, pgx.RowTo[string])
	require.NoError(t, err)
	orphanOrders, ordered := 0, map[string]bool{}
	for _, id := range orderIDs {
		ordered[id] = true
		if !evented[id] {
			orphanOrders++
		}
	}
	orphanEvents := 0
	for id := range evented {
		if !ordered[id] {
			orphanEvents++
		}
	}
	require.Zero(t, orphanOrders, "an order without its event")
	require.Zero(t, orphanEvents, "an event without its order")
	var r failoverResult
	acked.Range(func(k, _ any) bool {
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM ha_effects WHERE order_id = $1`, k.(int64)).Scan(&n); err != nil || n != 1 {
			r.lostAcked++
		}
		return true
	})
	externalMu.Lock()
	for id, calls := range external {
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM ha_orders WHERE id = $1`, id).Scan(&n); err != nil || n == 0 {
			r.effectsOfLost++
		}
		if calls > 1 {
			r.externalRepeats++
		}
	}
	externalMu.Unlock()
	var poisoned int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM poison_messages`).Scan(&poisoned))
	require.Zero(t, poisoned, "the failover was waited out, not blamed on messages")
	if relayMode == app.RelayModeCDC {
		var slots int
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'`).Scan(&slots))
		require.Equal(t, 1, slots, "the CDC relay made its slot anew on the new primary")
	}
	t.Logf("failover (synchronous %t): promoted %s after the crash; producers paused %s at most; %d orders acknowledged, %d refused; %d effects, each once; %d acknowledged lost; %d external calls repeated",
		synchronous, promoted.Round(time.Millisecond), longestGap.Round(time.Millisecond), count, failures.Load(), effects, r.lostAcked, r.externalRepeats)
	return r
}

// The case the failover replay is for, made to happen rather than waited
// for: an event's dispatch reaches the asynchronous standby, the standby
// is then cut off, the consumer's ledger transaction (its effect) commits
// on the primary alone and the broker forgets the message, and the
// primary crashes. On the promoted standby the event is dispatched and its
// effect is missing. The relay sees the new timeline and sends the event
// again: the effect runs (a second call outside, under the same message
// id), and an event whose effect the standby did receive is dropped by
// the ledger, not run twice. With FailoverReplay off the effect stays
// missing, which the test also checks.
func TestFailoverReplayRunsAnEffectWhoseLedgerCommitWasLost(t *testing.T) {
	t.Parallel()
	for _, replay := range []bool{true, false} {
		t.Run(fmt.Sprintf("replay=%t", replay), func(t *testing.T) {
			t.Parallel()
			lostLedgerCommit(t, replay)
		})
	}
}

func lostLedgerCommit(t *testing.T, replay bool) {
	ctx := context.Background()
	primary := pipelinetest.OwnPostgres(t)
	standby, err := primary.StartStandby(ctx, false)
	require.NoError(t, err)
	t.Cleanup(func() { _ = standby.Stop() })
	require.NoError(t, primary.Exec(ctx, "postgres", `CREATE TABLE ha_effects (order_id bigint NOT NULL)`))

	var mu sync.Mutex
	calls := map[int64]int{}
	entered, release := make(chan struct{}), make(chan struct{})
	a := startHA(t, primary, standby, func(cfg *app.Config) {
		if !replay {
			cfg.Relay.FailoverReplay = -1
		}
	}, func(id int64) {
		mu.Lock()
		calls[id]++
		first := id == 2 && calls[id] == 1
		mu.Unlock()
		if first {
			close(entered)
			<-release
		}
	})
	messageIDs := map[int64]string{}
	order := func(id int64) {
		require.NoError(t, a.Outbox().InTx(ctx, a.Pool(), func(ctx context.Context, _ pgoutbox.Querier, p *pgoutbox.Pending) error {
			evt, err := pipeline.NewEvent(ctx, strconv.FormatInt(id, 10), map[string]int64{"id": id})
			if err != nil {
				return err
			}
			messageIDs[id] = evt.UUID
			return p.PublishEvents(ctx, pipeline.Outgoing{Topic: "ha.order", Msg: evt})
		}))
	}
	count := func(s *pipelinetest.PostgresServer, sql string, args ...any) int {
		conn, err := pgx.Connect(ctx, s.URL("postgres"))
		if err != nil {
			return -1
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			return -1
		}
		return n
	}

	// Order 1 is done on both servers; order 2's dispatch reaches the
	// standby while its handler waits.
	order(1)
	require.Eventually(t, func() bool { return count(standby, `SELECT count(*) FROM ha_effects WHERE order_id = 1`) == 1 }, time.Minute, 50*time.Millisecond)
	order(2)
	<-entered
	require.Eventually(t, func() bool {
		return count(standby, `SELECT count(*) FROM `+pgoutbox.Table{}.View(pgoutbox.StateDispatched)+` o WHERE aggregate_id = '2'`) == 1
	}, time.Minute, 50*time.Millisecond, "order 2's dispatch reaches the standby")
	// Cut the standby off, then let the effect commit on the primary alone.
	require.NoError(t, standby.Exec(ctx, "postgres", `ALTER SYSTEM SET primary_conninfo = ''`))
	require.NoError(t, standby.Exec(ctx, "postgres", `SELECT pg_reload_conf()`))
	require.Eventually(t, func() bool { return count(primary, `SELECT count(*) FROM pg_stat_replication`) == 0 }, time.Minute, 50*time.Millisecond)
	close(release)
	require.Eventually(t, func() bool {
		return count(primary, `SELECT count(*) FROM processed_messages WHERE message_id = $1`, messageIDs[2]) == 1
	}, time.Minute, 50*time.Millisecond, "order 2's ledger commit on the primary")
	time.Sleep(time.Second) // the consumer's ack follows its commit within milliseconds
	require.Zero(t, count(standby, `SELECT count(*) FROM ha_effects WHERE order_id = 2`), "the standby lacks order 2's effect")

	require.NoError(t, primary.Halt())
	require.NoError(t, standby.Promote(ctx))
	if !replay {
		// Given as long as the replay takes below, and then some.
		time.Sleep(20 * time.Second)
		require.Zero(t, count(standby, `SELECT count(*) FROM ha_effects WHERE order_id = 2`), "without the replay, nothing sends order 2 again")
		return
	}
	require.Eventually(t, func() bool { return count(standby, `SELECT count(*) FROM ha_effects WHERE order_id = 2`) == 1 }, 90*time.Second, 100*time.Millisecond,
		"the relay sends order 2 again after the promotion and its effect runs")
	require.Equal(t, 1, count(standby, `SELECT count(*) FROM ha_effects WHERE order_id = 1`), "order 1's replay is dropped by the ledger")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, 1, calls[1], "order 1's handler did not run again")
	require.Equal(t, 2, calls[2], "order 2's handler ran again, under the same message id")
	require.Positive(t, a.Stats().Relay.Replayed)
}

// startHA runs the relay and the consumers of an app on primary, with
// standby listed after it in FERRY_DATABASE_URL (target_session_attrs
// read-write), until the test ends. Its one route, ha.effect on ha.order,
// calls outside(id) (what a handler does outside the database: a
// provider's call) and then records the order's effect in ha_effects in
// its ledger transaction. configure adjusts the configuration first.
func startHA(t *testing.T, primary, standby *pipelinetest.PostgresServer, configure func(*app.Config), outside func(id int64)) *app.App {
	t.Helper()
	ctx := context.Background()
	cfg, _, _ := testConfig(t)
	cfg.DatabaseURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		primary.Port, standby.Port)
	cfg.DatabaseSchema = ""
	configure(&cfg)
	a, err := app.New(ctx, cfg, app.Options{Migrate: true, Logger: slog.New(slog.DiscardHandler), Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "ha.effect", Topic: "ha.order", Handler: func(msg *message.Message) error {
			var o struct{ ID int64 }
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return pipeline.Permanent(err)
			}
			outside(o.ID)
			_, err := pgledger.TxFromContext(msg.Context()).Exec(msg.Context(), `INSERT INTO ha_effects (order_id) VALUES ($1)`, o.ID)
			return err
		}}}, nil
	}})
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, a.Topology())
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- a.Run(runCtx, app.Components{Relay: true, Consumers: true}, nil) }()
	t.Cleanup(func() {
		stop()
		<-ran
		a.Close()
	})
	return a
}
