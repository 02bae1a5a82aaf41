package bench

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// ScenarioProducerConcurrency measures what the relays' wake-up costs the
// application's commits: N writers committing create_order (a business
// row and two events, through InTx) with no wake-up at all, with the
// Waker (after the commit, from a connection of its own), with the Waker
// told by the pool's CommitWatch (the README's way to publish: no
// Committed, the pool sees the COMMIT) and with the in-transaction NOTIFY
// trigger Ferry used before (migration 00004);
// then, idle, how soon a relay of another process claims a commit.
const ScenarioProducerConcurrency = "producer_concurrency"

// The 00004 trigger, put back for the comparison.
var benchNotifyTrigger = `CREATE FUNCTION ferry_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ferry_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON ` + outboxSQL + ` FOR EACH STATEMENT EXECUTE FUNCTION ferry_outbox_notify()`

func benchProducerConcurrency(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	maxWriters := 0
	for _, w := range bc.Writers {
		maxWriters = max(maxWriters, w)
	}
	// Writers beyond the pool's connections wait for one, as an
	// application's goroutines do: two pools (plain and watched) must fit
	// the server's max_connections (100 by default) beside the others.
	conns := int32(min(maxWriters+4, 40))
	sch, err := newBenchSchema(ctx, cfg, conns)
	if err != nil {
		return benchReport{}, err
	}
	defer sch.drop()
	// A listener, as a relay keeps one: notifications are delivered.
	lconn, err := pgx.ConnectConfig(ctx, sch.pool.Config().ConnConfig.Copy())
	if err != nil {
		return benchReport{}, err
	}
	defer lconn.Close(context.WithoutCancel(ctx))
	if _, err := lconn.Exec(ctx, "LISTEN "+pgoutbox.NotifyChannel); err != nil {
		return benchReport{}, err
	}
	var notified atomic.Int64
	lctx, stopListen := context.WithCancel(ctx)
	listening := make(chan struct{})
	go func() {
		defer close(listening)
		for {
			if _, err := lconn.WaitForNotification(lctx); err != nil {
				return
			}
			notified.Add(1)
		}
	}()
	defer func() { stopListen(); <-listening }()

	plain, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return benchReport{}, err
	}
	woken, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return benchReport{}, err
	}
	waker := pgoutbox.NewWaker(sch.pool, pgoutbox.WakerConfig{Logger: logger})
	woken.SetWaker(waker)
	wctx, stopWaker := context.WithCancel(ctx)
	wdone := make(chan struct{})
	go func() { defer close(wdone); _ = waker.Run(wctx) }()
	defer func() { stopWaker(); <-wdone }()
	watch := pgoutbox.NewCommitWatch()
	watch.OnCommit(waker.Committed)
	watched, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: sch.name, ApplicationName: "ferry-bench-watched", MaxConns: conns, Configure: watch.Watch})
	if err != nil {
		return benchReport{}, err
	}
	defer watched.Close()

	var seq atomic.Int64
	// run commits create_order from n writers for d; the commit rate.
	run := func(ob *pgoutbox.Outbox, pool *pgxpool.Pool, n int, d time.Duration) (float64, error) {
		var done atomic.Int64
		var firstErr error
		var once sync.Once
		deadline := time.Now().Add(d)
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				for time.Now().Before(deadline) {
					k := seq.Add(1)
					if _, err := orders.CreateOrderInTx(ctx, ob, pool, orders.Input{UserID: "user-1", Amount: 1200, Currency: "JPY", IdempotencyKey: fmt.Sprintf("p-%d", k)}); err != nil {
						once.Do(func() { firstErr = err })
						return
					}
					done.Add(1)
				}
			})
		}
		wg.Wait()
		return float64(done.Load()) / d.Seconds(), firstErr
	}
	trigger := func(on bool) error {
		if on {
			_, err := sch.pool.Exec(ctx, benchNotifyTrigger)
			return err
		}
		_, err := sch.pool.Exec(ctx, `DROP TRIGGER IF EXISTS outbox_notify ON `+outboxSQL+`; DROP FUNCTION IF EXISTS ferry_outbox_notify()`)
		return err
	}
	type variant struct {
		name    string
		ob      *pgoutbox.Outbox
		pool    *pgxpool.Pool
		trigger bool
	}
	variants := []variant{{"no_wakeup", plain, sch.pool, false}, {"waker", woken, sch.pool, false}, {"watch", plain, watched, false}, {"trigger", plain, sch.pool, true}}
	results := map[int]map[string][]float64{}
	for _, n := range bc.Writers {
		results[n] = map[string][]float64{}
		for _, pool := range []*pgxpool.Pool{sch.pool, watched} {
			if _, err := run(plain, pool, n, time.Second); err != nil { // warm up connections and plans
				return benchReport{}, err
			}
		}
		for round := range bc.Rounds {
			// Rotated each round, so drift in the machine's load hits all alike.
			for j := range variants {
				v := variants[(round+j)%len(variants)]
				if err := trigger(v.trigger); err != nil {
					return benchReport{}, err
				}
				tps, err := run(v.ob, v.pool, n, bc.ProducerDuration)
				if err != nil {
					return benchReport{}, fmt.Errorf("%s with %d writers: %w", v.name, n, err)
				}
				if err := trigger(false); err != nil {
					return benchReport{}, err
				}
				results[n][v.name] = append(results[n][v.name], tps)
				if _, err := sch.pool.Exec(ctx, `TRUNCATE `+outboxSQL+`, orders`); err != nil {
					return benchReport{}, err
				}
			}
		}
	}

	lat, err := idleWakeLatency(ctx, cfg, sch, woken, logger)
	if err != nil {
		return benchReport{}, fmt.Errorf("idle wake-up latency: %w", err)
	}

	var tb strings.Builder
	js := map[string]any{"params": map[string]any{"writers": bc.Writers, "rounds": bc.Rounds, "seconds_per_run": bc.ProducerDuration.Seconds(),
		"transaction": "create_order through InTx: an order row and two events"}}
	fmt.Fprintf(&tb, "%-8s %12s %12s %12s %12s %12s %12s %13s\n", "writers", "no wake tps", "waker tps", "watch tps", "trigger tps", "waker/none", "watch/none", "trigger/none")
	met := true
	for _, n := range bc.Writers {
		none, wk, wa, tr := mean(results[n]["no_wakeup"]), mean(results[n]["waker"]), mean(results[n]["watch"]), mean(results[n]["trigger"])
		fmt.Fprintf(&tb, "%-8d %12.0f %12.0f %12.0f %12.0f %12.2f %12.2f %13.2f\n", n, none, wk, wa, tr, wk/none, wa/none, tr/none)
		js[fmt.Sprintf("writers_%d", n)] = map[string]any{"no_wakeup_tps": results[n]["no_wakeup"], "waker_tps": results[n]["waker"], "watch_tps": results[n]["watch"], "trigger_tps": results[n]["trigger"],
			"waker_ratio": wk / none, "watch_ratio": wa / none, "trigger_ratio": tr / none}
		if n >= 32 && min(wk, wa)/none < 0.9 {
			met = false
		}
	}
	fmt.Fprintf(&tb, "idle, commit -> relay's confirmed publish (another process's relay, woken by the Waker): p50 %.2f ms, p99 %.2f ms\n", lat["p50_ms"], lat["p99_ms"])
	js["idle_commit_to_publish"] = lat
	js["notifications_received"] = notified.Load()
	js["targets"] = map[string]any{"waker_ratio_min_at_32_writers": 0.9, "waker_ratio_met": met, "idle_p99_ms_max": 10, "idle_p99_met": lat["p99_ms"] <= 10}
	return benchReport{JSON: js, Table: tb.String()}, nil
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// idleWakeLatency commits one create_order every 20 ms through an outbox
// with a Waker and times each commit to the broker's confirm of its
// charge by a relay on a pool of its own (as another process's) whose
// poll interval is far longer than the run: only the wake-up is in time.
func idleWakeLatency(ctx context.Context, cfg app.Config, sch *benchSchema, ob *pgoutbox.Outbox, logger *slog.Logger) (map[string]float64, error) {
	br, err := newBenchBroker(cfg, orders.TopicChargeRequested, orders.TopicMailRequested)
	if err != nil {
		return nil, err
	}
	defer br.close()
	pub, err := rabbit.NewBatchPublisher(br.conn, br.topo)
	if err != nil {
		return nil, err
	}
	rpool, err := newPoolLike(ctx, sch)
	if err != nil {
		return nil, err
	}
	defer rpool.Close()
	var mu sync.Mutex
	committed, published := map[string]time.Time{}, map[string]time.Time{}
	relay, err := pgoutbox.NewRelay(rpool, pub, pgoutbox.RelayConfig{OrderedTopics: orderedOf(pub), PollInterval: time.Minute, Observer: func(outs []pgoutbox.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		for _, o := range outs {
			if o.Err == nil && o.Topic == orders.TopicChargeRequested {
				published[o.AggregateID] = o.At
			}
		}
	}}, logger)
	if err != nil {
		return nil, err
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(rctx) }()
	defer func() { stop(); <-done }()
	time.Sleep(500 * time.Millisecond) // listening and asleep
	const n = 300
	for i := range n {
		res, err := orders.CreateOrderInTx(ctx, ob, sch.pool, orders.Input{UserID: "user-1", Amount: 1200, Currency: "JPY", IdempotencyKey: fmt.Sprintf("idle-%d", i)})
		at := time.Now()
		if err != nil {
			return nil, err
		}
		mu.Lock()
		committed[fmt.Sprint(res.OrderID)] = at
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		got := len(published)
		mu.Unlock()
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of %d charges published within 10s of the last commit: the wake-up did not reach the relay", got, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	var lat latencies
	for id, at := range committed {
		lat = append(lat, published[id].Sub(at))
	}
	return lat.summary(), nil
}

// newPoolLike opens another pool on sch's schema, as another process's.
func newPoolLike(ctx context.Context, sch *benchSchema) (*pgxpool.Pool, error) {
	return pgxpool.NewWithConfig(ctx, sch.pool.Config().Copy())
}
