package bench

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// Scenarios of the consumer's cost and of the whole pipeline's drain.
const (
	// ScenarioConsumerThroughput: a consumer process (the app's router and
	// chain, a no-op handler, the real ledger) drains a queue filled
	// beforehand: CPU per message (user + system), messages/s, peak RSS.
	ScenarioConsumerThroughput = "consumer_throughput"
	// ScenarioEndToEndDrain: writers commit business transactions (a row
	// and its event) as fast as they can while a relay process and a
	// consumer process run; effects/s from the first commit to the last
	// effect recorded by the consumer.
	ScenarioEndToEndDrain = "end_to_end_drain"
)

// benchPipeline is a schema, a broker namespace with the memory route's
// binding, and the FERRY_* environment of child processes on both.
type benchPipeline struct {
	sch  *benchSchema
	topo *rabbit.Topology
	conn interface{ Close() error }
	env  []string
	drop func()
}

func newBenchPipeline(ctx context.Context, cfg app.Config, bc BenchConfig, maxConns int32) (*benchPipeline, error) {
	sch, err := newBenchSchema(ctx, cfg, maxConns)
	if err != nil {
		return nil, err
	}
	rc := cfg.AMQP
	rc.Namespace = fmt.Sprintf("ferrybench%d.", time.Now().UnixNano())
	topo, err := rabbit.NewTopology(rc)
	if err != nil {
		sch.drop()
		return nil, err
	}
	conn, err := rabbit.Dial(rc, "ferry-bench", watermill.NopLogger{})
	if err != nil {
		sch.drop()
		return nil, err
	}
	if err := topo.Declare(conn.Connection(), rabbit.Binding{Topic: memoryTopic, Queue: memoryQueue}); err != nil {
		conn.Close()
		sch.drop()
		return nil, err
	}
	env := []string{ChildProfileEnv + "=" + bc.CPUProfile, "FERRY_DATABASE_URL=" + cfg.DatabaseURL, "FERRY_DATABASE_SCHEMA=" + sch.name,
		"FERRY_AMQP_URL=" + cfg.AMQP.URL, "FERRY_AMQP_NAMESPACE=" + rc.Namespace, "FERRY_ADMIN_ADDR=off",
		"FERRY_RELAY_BATCH_SIZE=" + strconv.Itoa(bc.BatchSize), "FERRY_DATABASE_MAX_CONNS=" + strconv.Itoa(bc.ConsumerConns)}
	return &benchPipeline{sch: sch, topo: topo, conn: conn, env: env, drop: func() {
		_ = topo.Teardown(conn.Connection())
		conn.Close()
		sch.drop()
	}}, nil
}

// consumerVariants are the consumers the consumer scenarios compare in one
// run: a route of single messages (a transaction each) and a batch route.
var consumerVariants = []struct{ kind, name string }{{"consume", "per message"}, {batchConsumer, "batch"}}

func benchConsumerThroughput(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	var tb strings.Builder
	out := map[string]any{}
	for _, v := range consumerVariants {
		run, err := consumerThroughput(ctx, cfg, bc, logger, v.kind)
		if err != nil {
			return benchReport{}, fmt.Errorf("%s: %w", v.name, err)
		}
		n := bc.ConsumerEvents
		cpuUS := float64(run.cpu.Microseconds()) / float64(n)
		rate := float64(n) / run.seconds
		fmt.Fprintf(&tb, "%s: a consumer process drained %d messages in %.1fs: %.0f messages/s, CPU %.1f µs per message (%.2fs user+system), peak RSS %.1f MB\n",
			v.name, n, run.seconds, rate, cpuUS, run.cpu.Seconds(), float64(run.peakRSS)/(1<<20))
		res := map[string]any{
			"cpu_us_per_message":   cpuUS,
			"messages_per_second":  rate,
			"peak_rss_bytes":       run.peakRSS,
			"seconds":              run.seconds,
			"cpu_seconds_user_sys": run.cpu.Seconds(),
			"targets":              map[string]any{"cpu_us_per_message_max": 100, "cpu_met": cpuUS <= 100, "peak_rss_mb_max": 40, "rss_met": run.peakRSS <= 40<<20},
		}
		if v.kind == batchConsumer {
			out["batch"] = res
			continue
		}
		maps.Copy(out, res)
	}
	out["params"] = map[string]any{"messages": bc.ConsumerEvents, "database_max_conns": bc.ConsumerConns,
		"handler": "no-op, real ledger", "batch": fmt.Sprintf("handlers.Batch defaults (MaxSize %d, MaxWait %s, MaxGap %s)", middleware.DefaultBatchMaxSize, middleware.DefaultBatchMaxWait, middleware.DefaultBatchMaxGap)}
	return benchReport{JSON: out, Table: tb.String()}, nil
}

// consumerThroughput fills a queue with bc.ConsumerEvents messages and
// drains it with a consumer child of kind.
func consumerThroughput(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger, kind string) (consumerRun, error) {
	p, err := newBenchPipeline(ctx, cfg, bc, 8)
	if err != nil {
		return consumerRun{}, err
	}
	defer p.drop()
	n := bc.ConsumerEvents
	if err := fillQueue(ctx, p, bc, logger, n); err != nil {
		return consumerRun{}, err
	}
	return drainWithConsumer(ctx, p.sch, bc, p.env, n, kind)
}

// fillQueue empties the outbox, writes n events to it and relays them into
// the pipeline's queue with this process's relay (not what is measured).
func fillQueue(ctx context.Context, p *benchPipeline, bc BenchConfig, logger *slog.Logger, n int) error {
	if err := preload(ctx, p.sch.pool, memoryTopic, n); err != nil {
		return err
	}
	rconn, err := rabbit.Dial(p.topo.Config(), "ferry-bench-fill", watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer rconn.Close()
	pub, err := rabbit.NewBatchPublisher(rconn, p.topo)
	if err != nil {
		return err
	}
	relay, err := pgoutbox.NewRelay(p.sch.pool, pub, pgoutbox.RelayConfig{OrderedTopics: pub.OrderedTopics(), BatchSize: bc.BatchSize, PollOnly: true, PollInterval: 20 * time.Millisecond}, logger)
	if err != nil {
		return err
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(rctx) }()
	err = waitFor(ctx, 5*time.Minute, func() (bool, error) {
		pending, err := pgoutbox.Table{}.PendingCount(ctx, p.sch.pool)
		return pending == 0, err
	})
	stop()
	<-done
	if err != nil {
		return fmt.Errorf("filling the queue: %w", err)
	}
	return nil
}

func benchEndToEndDrain(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	writers := bc.DrainWriters
	var tb strings.Builder
	out := map[string]any{}
	for _, v := range consumerVariants {
		res, err := endToEndDrain(ctx, cfg, bc, logger, writers, v.kind)
		if err != nil {
			return benchReport{}, fmt.Errorf("%s: %w", v.name, err)
		}
		fmt.Fprintf(&tb, "%s consumer: %d business transactions (a row and its event) from %d writers: committed in %.1fs (%.0f/s), every effect recorded after %.1fs: %.0f effects/s\n",
			v.name, bc.DrainEvents, writers, res["commit_seconds"], res["commits_per_second"], res["seconds"], res["effects_per_second"])
		m := res["machine_cpu_us_per_effect"].(map[string]any)
		fmt.Fprintf(&tb, "  CPU per effect: relay process %.1f µs, consumer process %.1f µs, PostgreSQL %.1f µs, RabbitMQ %.1f µs, producers %.1f µs; machine %.1f µs (%.0f%% busy)\n",
			res["relay_cpu_us_per_event"], res["consumer_cpu_us_per_event"], m["postgresql"], m["rabbitmq"], m["producers"], m["all"], 100*res["machine_busy"].(float64))
		if v.kind == batchConsumer {
			out["batch"] = res
			continue
		}
		maps.Copy(out, res)
	}
	out["params"] = map[string]any{"transactions": bc.DrainEvents, "writers": writers, "relay_processes": 1, "consumer_processes": 1}
	return benchReport{JSON: out, Table: tb.String()}, nil
}

func endToEndDrain(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger, writers int, kind string) (map[string]any, error) {
	p, err := newBenchPipeline(ctx, cfg, bc, int32(writers)+4)
	if err != nil {
		return nil, err
	}
	defer p.drop()
	n := bc.DrainEvents
	ob, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return nil, err
	}
	// The producers' wake-ups go to the relay process as they would from
	// an application's.
	waker := pgoutbox.NewWaker(p.sch.pool, pgoutbox.WakerConfig{Logger: logger})
	ob.SetWaker(waker)
	wctx, stopWaker := context.WithCancel(ctx)
	wdone := make(chan struct{})
	go func() { defer close(wdone); _ = waker.Run(wctx) }()
	defer func() { stopWaker(); <-wdone }()

	relay, err := startChild(bc.Binary, "relay", p.env)
	if err != nil {
		return nil, err
	}
	defer relay.stop()
	cons, err := startChild(bc.Binary, kind, p.env)
	if err != nil {
		return nil, err
	}
	defer cons.stop()
	// Both ready: a first effect went through.
	if err := commitEvents(ctx, p.sch, ob, 1, 1, "warm"); err != nil {
		return nil, err
	}
	if err := waitFor(ctx, time.Minute, func() (bool, error) { return processed(ctx, p.sch, 1) }); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	start, cpu0, srv0 := time.Now(), readCPU(), readServerCPU()
	if err := commitEvents(ctx, p.sch, ob, writers, n, "drain"); err != nil {
		return nil, err
	}
	committedSecs := time.Since(start).Seconds()
	if err := waitFor(ctx, 5*time.Minute, func() (bool, error) { return processed(ctx, p.sch, n+1) }); err != nil {
		return nil, fmt.Errorf("drain: %w", err)
	}
	secs := time.Since(start).Seconds()
	cpu1, srv1 := readCPU(), readServerCPU()
	relay.stop()
	cons.stop()
	relayCPU := relay.cmd.ProcessState.UserTime() + relay.cmd.ProcessState.SystemTime()
	consCPU := cons.cmd.ProcessState.UserTime() + cons.cmd.ProcessState.SystemTime()
	rate := float64(n) / secs
	return map[string]any{
		"machine_busy":              cpu1.busySince(cpu0),
		"machine_cpu_us_per_effect": cpuPerEvent(cpu0, cpu1, srv0, srv1, n, "producers"),
		"effects_per_second":        rate,
		"commits_per_second":        float64(n) / committedSecs,
		"commit_seconds":            committedSecs,
		"seconds":                   secs,
		"relay_cpu_us_per_event":    float64(relayCPU.Microseconds()) / float64(n),
		"consumer_cpu_us_per_event": float64(consCPU.Microseconds()) / float64(n),
		"targets":                   map[string]any{"effects_per_second_min": 4000, "met": rate >= 4000},
	}, nil
}

// commitEvents commits n business transactions (an order row and one
// event, through InTx) from writers goroutines.
func commitEvents(ctx context.Context, sch *benchSchema, ob *pgoutbox.Outbox, writers, n int, prefix string) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(n) {
					return
				}
				err := ob.InTx(ctx, sch.pool, func(ctx context.Context, q pgoutbox.Querier, pend *pgoutbox.Pending) error {
					var id int64
					if err := q.QueryRow(ctx, `INSERT INTO orders (user_id, amount, currency, idempotency_key) VALUES ($1, 1200, 'JPY', $2) RETURNING id`,
						"user-1", fmt.Sprintf("%s-%d", prefix, i)).Scan(&id); err != nil {
						return err
					}
					evt, err := pipeline.NewEvent(ctx, strconv.FormatInt(id, 10), map[string]int64{"order_id": id})
					if err != nil {
						return err
					}
					return pend.PublishEvents(ctx, pipeline.Outgoing{Topic: memoryTopic, Msg: evt})
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func processed(ctx context.Context, sch *benchSchema, n int) (bool, error) {
	var done int
	err := sch.pool.QueryRow(ctx, `SELECT count(*) FROM processed_messages`).Scan(&done)
	return done >= n, err
}
