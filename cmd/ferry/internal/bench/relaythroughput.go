package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The relay_throughput scenario: relays against the raw loops they are
// measured by, and the Watermill forwarder baseline.

func benchRelayThroughput(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	maxRelays := slices.Max(bc.Relays)
	sch, err := newBenchSchema(ctx, cfg, int32((max(bc.InFlight, pgoutbox.DefaultRelayInFlight)+1)*maxRelays+4))
	if err != nil {
		return benchReport{}, err
	}
	defer sch.drop()
	br, err := newBenchBroker(cfg, benchTopic)
	if err != nil {
		return benchReport{}, err
	}
	defer br.close()
	pub, err := rabbit.NewBatchPublisher(br.conn, br.topo)
	if err != nil {
		return benchReport{}, err
	}
	defer pub.Close()

	type row struct {
		Relays           int     `json:"relays"`
		Events           int     `json:"events"`
		Seconds          float64 `json:"seconds"`
		EventsPerSec     float64 `json:"events_per_sec"`
		RawPublishPerSec float64 `json:"raw_publish_per_sec"`
		RawUpdatePerSec  float64 `json:"raw_update_per_sec"`
		LowerRawLimit    float64 `json:"lower_raw_limit_per_sec"`
		RatioVsRawLimit  float64 `json:"ratio_vs_lower_raw_limit"`
		RatioVsBaseline  float64 `json:"ratio_vs_baseline"`
		AtBroker         int     `json:"messages_at_broker"`
		// CPUBusy is the machine's CPU use (all cores, PostgreSQL and
		// RabbitMQ included) while our relays ran: 1 means saturated.
		CPUBusy float64 `json:"machine_cpu_busy"`
	}
	var rows []row
	for _, n := range bc.Relays {
		r := row{Relays: n, Events: bc.Events}
		// Ours.
		if err := preload(ctx, sch.pool, benchTopic, bc.Events); err != nil {
			return benchReport{}, err
		}
		if err := br.purge(); err != nil {
			return benchReport{}, err
		}
		cpu0 := readCPU()
		secs, err := runRelays(ctx, sch.pool, pub, n, bc, logger)
		if err != nil {
			return benchReport{}, err
		}
		r.CPUBusy = readCPU().busySince(cpu0)
		r.Seconds, r.EventsPerSec = secs, float64(bc.Events)/secs
		if r.AtBroker, err = waitDepth(br, bc.Events, 30*time.Second); err != nil {
			return benchReport{}, err
		}
		// Raw limits on the same rows and the same broker, same batching and concurrency.
		if r.RawUpdatePerSec, err = rawUpdateLoop(ctx, sch.pool, bc.Events, bc.BatchSize, n); err != nil {
			return benchReport{}, err
		}
		if err := br.purge(); err != nil {
			return benchReport{}, err
		}
		if r.RawPublishPerSec, err = rawPublishLoop(ctx, br, bc.Events, bc.BatchSize, n); err != nil {
			return benchReport{}, err
		}
		r.LowerRawLimit = math.Min(r.RawPublishPerSec, r.RawUpdatePerSec)
		r.RatioVsRawLimit = r.EventsPerSec / r.LowerRawLimit
		rows = append(rows, r)
	}
	var cdcRow *row
	if slices.Contains(bc.RelayModes, app.RelayModeCDC) {
		if err := br.purge(); err != nil {
			return benchReport{}, err
		}
		r := row{Relays: 1, Events: bc.Events}
		cpu0 := readCPU()
		secs, err := runCDC(ctx, sch.pool, pub, bc, logger)
		if err != nil {
			return benchReport{}, fmt.Errorf("cdc: %w", err)
		}
		r.CPUBusy = readCPU().busySince(cpu0)
		r.Seconds, r.EventsPerSec = secs, float64(bc.Events)/secs
		if r.AtBroker, err = waitDepth(br, bc.Events, 30*time.Second); err != nil {
			return benchReport{}, err
		}
		r.RawPublishPerSec, r.RawUpdatePerSec, r.LowerRawLimit = rows[0].RawPublishPerSec, rows[0].RawUpdatePerSec, rows[0].LowerRawLimit
		r.RatioVsRawLimit = r.EventsPerSec / r.LowerRawLimit
		cdcRow = &r
	}
	if err := br.purge(); err != nil {
		return benchReport{}, err
	}
	baseRate, baseDone, baseSecs, err := benchForwarderBaseline(ctx, cfg, sch, br, bc.BaselineEvents, logger)
	if err != nil {
		return benchReport{}, fmt.Errorf("baseline: %w", err)
	}
	for i := range rows {
		rows[i].RatioVsBaseline = rows[i].EventsPerSec / baseRate
	}
	if cdcRow != nil {
		cdcRow.RatioVsBaseline = cdcRow.EventsPerSec / baseRate
	}
	best := slices.MaxFunc(rows, func(a, b row) int { return cmpFloat(a.EventsPerSec, b.EventsPerSec) })

	var tb strings.Builder
	fmt.Fprintf(&tb, "%-7s %9s %10s %12s %12s %12s %9s %9s %6s\n", "relays", "events", "events/s", "raw pub/s", "raw upd/s", "ours/raw", "ours/base", "at broker", "cpu")
	for _, r := range rows {
		fmt.Fprintf(&tb, "%-7d %9d %10.0f %12.0f %12.0f %11.0f%% %8.1fx %9d %5.0f%%\n", r.Relays, r.Events, r.EventsPerSec, r.RawPublishPerSec, r.RawUpdatePerSec, 100*r.RatioVsRawLimit, r.RatioVsBaseline, r.AtBroker, 100*r.CPUBusy)
	}
	var cdcJSON any
	if r := cdcRow; r != nil {
		fmt.Fprintf(&tb, "%-7s %9d %10.0f %12.0f %12.0f %11.0f%% %8.1fx %9d %5.0f%%  (cdc: one streamer per slot; %.2fx the notify relay with 1 relay)\n", "cdc", r.Events, r.EventsPerSec, r.RawPublishPerSec, r.RawUpdatePerSec, 100*r.RatioVsRawLimit, r.RatioVsBaseline, r.AtBroker, 100*r.CPUBusy, r.EventsPerSec/rows[0].EventsPerSec)
		cdcJSON = map[string]any{"run": r, "ratio_vs_notify_1_relay": r.EventsPerSec / rows[0].EventsPerSec}
	}
	fmt.Fprintf(&tb, "baseline (Watermill forwarder, default watermill-sql schema): %.0f events/s (%d of %d in %.1fs)\n", baseRate, baseDone, bc.BaselineEvents, baseSecs)
	return benchReport{
		JSON: map[string]any{
			"params": map[string]any{"events": bc.Events, "relays": bc.Relays, "batch_size": bc.BatchSize, "in_flight": bc.InFlight, "queue_type": cfg.AMQP.QueueType, "baseline_events": bc.BaselineEvents, "relay_modes": append([]string{app.RelayModeNotify}, bc.RelayModes...)},
			"runs":   rows,
			"cdc":    cdcJSON,
			"baseline": map[string]any{
				"name":   "watermill components/forwarder over watermill-sql DefaultPostgreSQLSchema, watermill-amqp publisher with confirms",
				"events": bc.BaselineEvents, "forwarded": baseDone, "seconds": baseSecs, "events_per_sec": baseRate,
			},
			"best": map[string]any{"relays": best.Relays, "events_per_sec": best.EventsPerSec, "ratio_vs_baseline": best.RatioVsBaseline, "ratio_vs_lower_raw_limit": best.RatioVsRawLimit},
			"targets": map[string]any{
				"ratio_vs_baseline_min": 20.0, "ratio_vs_baseline_met": best.RatioVsBaseline >= 20,
				"ratio_vs_lower_raw_limit_min": 0.70, "ratio_vs_lower_raw_limit_met": best.RatioVsRawLimit >= 0.70,
			},
		},
		Table: tb.String(),
	}, nil
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func runRelays(ctx context.Context, pool *pgxpool.Pool, pub message.Publisher, n int, bc BenchConfig, logger *slog.Logger) (float64, error) {
	relays := make([]*pgoutbox.Relay, n)
	for i := range relays {
		r, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{OrderedTopics: orderedOf(pub), BatchSize: bc.BatchSize, CatchUpBatchSize: bc.BatchSize, InFlight: bc.InFlight, PollInterval: 20 * time.Millisecond, PollOnly: true}, logger)
		if err != nil {
			return 0, err
		}
		relays[i] = r
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	start := time.Now()
	for _, r := range relays {
		wg.Go(func() { _ = r.Run(rctx) })
	}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		var done int64
		for _, r := range relays {
			done += r.Stats().Dispatched
		}
		if done >= int64(bc.Events) {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			cancel()
			wg.Wait()
			return 0, fmt.Errorf("relays dispatched %d of %d events before giving up", done, bc.Events)
		}
		time.Sleep(2 * time.Millisecond)
	}
	secs := time.Since(start).Seconds()
	cancel()
	wg.Wait()
	return secs, nil
}

// runCDC times the CDC relay draining a backlog of bc.Events rows, like
// runRelays times the polling relays: the slot is created first (rows
// committed before it are not in its stream), the backlog written while
// no streamer runs, then one streamer started and timed until it has
// dispatched them all. Its slot and publication are dropped after.
func runCDC(ctx context.Context, pool *pgxpool.Pool, pub message.Publisher, bc BenchConfig, logger *slog.Logger) (float64, error) {
	rows, err := pgoutbox.Table{}.PendingCount(ctx, pool)
	if err != nil {
		return 0, err
	}
	if rows != 0 {
		return 0, fmt.Errorf("outbox holds %d pending rows before the cdc run", rows)
	}
	relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{OrderedTopics: orderedOf(pub), BatchSize: bc.BatchSize}, logger)
	if err != nil {
		return 0, err
	}
	slot := fmt.Sprintf("ferry_bench_%d", time.Now().UnixNano())
	cfg := pgcdc.Config{Slot: slot, BatchSize: max(bc.BatchSize, pgcdc.DefaultBatchSize)}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_, _, _ = pgcdc.DropWhenInactive(dctx, pool, slot, slot) // .ci/leftovers would name a slot left behind
	}()
	run := func() (*pgcdc.Streamer, func(), error) { return startStreamer(ctx, pool, relay, cfg, logger) }
	_, stop, err := run() // creates the slot
	if err != nil {
		return 0, err
	}
	stop()
	if err := preload(ctx, pool, benchTopic, bc.Events); err != nil {
		return 0, err
	}
	start := time.Now()
	s, stop, err := run()
	if err != nil {
		return 0, err
	}
	defer stop()
	deadline := time.Now().Add(10 * time.Minute)
	for s.Stats().Dispatched < int64(bc.Events) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return 0, fmt.Errorf("the CDC relay dispatched %d of %d events before giving up", s.Stats().Dispatched, bc.Events)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return time.Since(start).Seconds(), nil
}

// startStreamer runs a CDC streamer of relay until the returned stop is
// called, once it streams (bound: 30 s).
func startStreamer(ctx context.Context, pool *pgxpool.Pool, relay *pgoutbox.Relay, cfg pgcdc.Config, logger *slog.Logger) (*pgcdc.Streamer, func(), error) {
	s, err := pgcdc.NewStreamer(pool, relay, pgoutbox.Table{}, cfg, logger)
	if err != nil {
		return nil, nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(sctx) }()
	stop := func() { cancel(); <-done }
	deadline := time.Now().Add(30 * time.Second)
	for !s.Stats().Active {
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, nil, errors.New("the CDC streamer did not start streaming within 30s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return s, stop, nil
}

func waitDepth(br *benchBroker, want int, timeout time.Duration) (int, error) {
	deadline := time.Now().Add(timeout)
	for {
		n, err := br.depth()
		if err != nil {
			return 0, err
		}
		if n >= want || time.Now().After(deadline) {
			if n < want {
				return n, fmt.Errorf("broker holds %d of %d messages", n, want)
			}
			return n, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// rawUpdateLoop is the database's limit: mark the preloaded rows dispatched
// in batches, from conc connections, with nothing else to do.
func rawUpdateLoop(ctx context.Context, pool *pgxpool.Pool, events, batch, conc int) (float64, error) {
	if _, err := pool.Exec(ctx, `UPDATE `+outboxSQL+` SET dispatched_at = NULL, attempts = 0`); err != nil {
		return 0, err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outboxSQL); err != nil {
		return 0, err
	}
	var next atomic.Int64
	errs := make(chan error, conc)
	start := time.Now()
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for {
				from := next.Add(int64(batch)) - int64(batch) + 1
				if from > int64(events) {
					return
				}
				ids := make([]int64, 0, batch)
				for id := from; id < from+int64(batch) && id <= int64(events); id++ {
					ids = append(ids, id)
				}
				if _, err := pool.Exec(ctx, `UPDATE `+outboxSQL+` SET dispatched_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`, ids); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, fmt.Errorf("raw update loop: %w", err)
	}
	return float64(events) / time.Since(start).Seconds(), nil
}

// rawPublishLoop is the broker's limit: the same messages published in the
// same batches with pipelined confirms, from conc channels, nothing else.
func rawPublishLoop(ctx context.Context, br *benchBroker, events, batch, conc int) (float64, error) {
	body := []byte(`{"order_id":123456,"user_id":"user-123","amount":1200,"currency":"JPY"}`)
	headers := amqp.Table{"schema_version": "1", "correlation_id": "0123456789abcdef0123456789abcdef", "aggregate_id": "123"}
	exchange := br.topo.ExchangeName(benchTopic)
	var next atomic.Int64
	errs := make(chan error, conc)
	var wg sync.WaitGroup
	start := time.Now()
	for range conc {
		wg.Go(func() {
			ch, err := br.conn.Connection().Channel()
			if err != nil {
				errs <- err
				return
			}
			defer ch.Close()
			if err := ch.Confirm(false); err != nil {
				errs <- err
				return
			}
			for {
				from := next.Add(int64(batch)) - int64(batch)
				if from >= int64(events) {
					return
				}
				n := min(int64(batch), int64(events)-from)
				dcs := make([]*amqp.DeferredConfirmation, 0, n)
				// The same writes as BatchPublisher's: the batch in one.
				release := rabbit.HoldWrites(br.conn)
				for i := range n {
					dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, "", false, false, amqp.Publishing{
						Body: body, Headers: headers, DeliveryMode: amqp.Persistent, ContentType: "application/json",
						MessageId: strconv.FormatInt(from+i, 10),
					})
					if err != nil {
						_ = release()
						errs <- err
						return
					}
					dcs = append(dcs, dc)
				}
				if err := release(); err != nil {
					errs <- err
					return
				}
				for _, dc := range dcs {
					if ok, err := dc.WaitContext(ctx); err != nil || !ok {
						errs <- errors.Join(err, errors.New("raw publish not confirmed"))
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, fmt.Errorf("raw publish loop: %w", err)
	}
	return float64(events) / time.Since(start).Seconds(), nil
}

// benchForwarderBaseline pushes the load through what a Watermill user
// would otherwise deploy: components/forwarder reading watermill-sql's
// default PostgreSQL schema and publishing with watermill-amqp (confirms on).
func benchForwarderBaseline(ctx context.Context, cfg app.Config, sch *benchSchema, br *benchBroker, events int, logger *slog.Logger) (rate float64, done int, secs float64, err error) {
	const fwdTopic = "ferry_bench_forwarder"
	wlog := watermill.NopLogger{}
	sqlPub, err := wsql.NewPublisher(sch.db, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, wlog)
	if err != nil {
		return 0, 0, 0, err
	}
	fwdPub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: fwdTopic})
	for start := 0; start < events; start += 500 {
		var msgs []*message.Message
		for i := start; i < min(events, start+500); i++ {
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order_id":%d,"user_id":"user-%d","amount":1200,"currency":"JPY"}`, i, i%977)))
			m.Metadata.Set("schema_version", "1")
			m.Metadata.Set("correlation_id", watermill.NewUUID())
			msgs = append(msgs, m)
		}
		if err := fwdPub.Publish(benchTopic, msgs...); err != nil {
			return 0, 0, 0, fmt.Errorf("preloading baseline: %w", err)
		}
	}
	sub, err := wsql.NewSubscriber(sch.db, wsql.SubscriberConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, wlog)
	if err != nil {
		return 0, 0, 0, err
	}
	amqpPub, err := wamqp.NewPublisher(br.topo.PublisherConfig(), wlog)
	if err != nil {
		return 0, 0, 0, err
	}
	defer amqpPub.Close()
	fwd, err := forwarder.NewForwarder(sub, amqpPub, wlog, forwarder.Config{ForwarderTopic: fwdTopic})
	if err != nil {
		return 0, 0, 0, err
	}
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = fwd.Run(fctx) }()
	defer fwd.Close()
	<-fwd.Running()
	start := time.Now()
	deadline := start.Add(5 * time.Minute)
	for {
		n, err := br.depth()
		if err != nil {
			return 0, 0, 0, err
		}
		done = n
		if n >= events || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	secs = time.Since(start).Seconds()
	return float64(done) / secs, done, secs, nil
}
