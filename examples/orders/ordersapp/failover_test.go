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

	cfg, _, _ := testConfig(t)
	cfg.DatabaseURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		primary.Port, standby.Port)
	cfg.DatabaseSchema = ""
	cfg.Retry.MaxRetries = 3
	cfg.RelayMode = relayMode
	if relayMode == app.RelayModeCDC {
		cfg.CDCSafetyNetInterval, cfg.CDCSafetyNetMinAge = 500*time.Millisecond, 2*time.Second
	}
	// What the handler did outside the database (a provider's call), by order.
	var externalMu sync.Mutex
	external := map[int64]int{}
	a, err := app.New(ctx, cfg, app.Options{Migrate: true, Logger: slog.New(slog.DiscardHandler), Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "ha.effect", Topic: "ha.order", Handler: func(msg *message.Message) error {
			var o struct{ ID int64 }
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return pipeline.Permanent(err)
			}
			externalMu.Lock()
			external[o.ID]++
			externalMu.Unlock()
			_, err := pgledger.TxFromContext(msg.Context()).Exec(msg.Context(), `INSERT INTO ha_effects (order_id) VALUES ($1)`, o.ID)
			return err
		}}}, nil
	}})
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, a.Topology())
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- a.Run(runCtx, app.Components{Relay: true, Consumers: true}, nil) }()
	defer func() {
		stop()
		<-ran
		a.Close()
	}()

	// The producer: an order and its event per transaction, 200/s; an
	// order counts once its commit was acknowledged.
	var acked sync.Map // id → when its commit was acknowledged
	var next, failures atomic.Int64
	var lastAck time.Time
	var longestGap time.Duration // the producers' pause: the longest time without an acknowledged commit
	produce := func(until time.Time) {
		for time.Now().Before(until) {
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
	wg.Go(func() { produce(time.Now().Add(8 * time.Second)) })
	time.Sleep(3 * time.Second)
	crashed := time.Now()
	require.NoError(t, primary.Halt())
	require.NoError(t, standby.Promote(ctx))
	promoted := time.Since(crashed)
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
	require.GreaterOrEqual(t, after, 20, "orders were taken again after the promotion (%d refused meanwhile)", failures.Load())
	conn, err := pgx.Connect(ctx, standby.URL("postgres"))
	require.NoError(t, err)
	defer conn.Close(ctx)
	var effects, distinct int
	require.Eventually(t, func() bool {
		missing := 0
		rows, err := conn.Query(ctx, `SELECT o.id FROM ha_orders o LEFT JOIN ha_effects e ON e.order_id = o.id WHERE e.order_id IS NULL`)
		if err != nil {
			return false
		}
		for rows.Next() {
			missing++
		}
		rows.Close()
		return missing == 0
	}, 90*time.Second, 250*time.Millisecond, "every order on the new primary gets its effect")
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM ha_effects`).Scan(&effects, &distinct))
	require.Equal(t, distinct, effects, "no effect twice")
	// Consistent whatever was lost: an order and its event together.
	var orphanOrders, orphanEvents int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM ha_orders o WHERE NOT EXISTS (SELECT 1 FROM outbox e WHERE e.topic = 'ha.order' AND e.aggregate_id = o.id::text)`).Scan(&orphanOrders))
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM outbox e WHERE e.topic = 'ha.order' AND NOT EXISTS (SELECT 1 FROM ha_orders o WHERE o.id::text = e.aggregate_id)`).Scan(&orphanEvents))
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
