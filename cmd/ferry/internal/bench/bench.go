package bench

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	exmigrations "github.com/ferry-dev/ferry/examples/orders/migrations"

	"github.com/ferry-dev/ferry/app"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// Benchmark scenarios of `ferry bench`.
const (
	ScenarioRelayThroughput = "relay_throughput"
	ScenarioEndToEnd        = "end_to_end_latency"
	ScenarioWriteOverhead   = "write_overhead"
	ScenarioClaimCost       = "claim_cost_vs_history"
)

// BenchScenarios lists every scenario, in the order they run.
var BenchScenarios = []string{ScenarioRelayThroughput, ScenarioEndToEnd, ScenarioWriteOverhead, ScenarioProducerConcurrency, ScenarioClaimCost, ScenarioMemory,
	ScenarioConsumerThroughput, ScenarioEndToEndDrain, ScenarioUpcast, ScenarioHeldXmin, ScenarioHeldXminSteady}

// BenchConfig sets the size of each scenario. Zero fields take the defaults.
type BenchConfig struct {
	// Scenarios to run. Default: all of BenchScenarios.
	Scenarios []string
	// CPUProfile, when set, is where the memory scenario's child processes
	// write their CPU profiles (with their kind and pid appended).
	CPUProfile string
	// Events preloaded for relay_throughput. Default 50,000.
	Events int
	// BaselineEvents preloaded for Watermill's stock forwarder, which is far
	// slower; its rate is compared, not its total time. Default 5,000.
	BaselineEvents int
	// Relays are the relay counts relay_throughput runs. Default 1, 2, 4.
	Relays []int
	// BatchSize of the relay and of the raw loops. Default 100.
	// relay_throughput's relays read every page at this size (their
	// CatchUpBatchSize too), so that they compare with the raw loops'
	// batches; the other scenarios run the relay's catch-up pages as
	// configured.
	BatchSize int
	// InFlight is the relays' batches in flight (pgoutbox.RelayConfig.InFlight).
	// Default: the relay's default.
	InFlight int
	// Rate is end_to_end_latency's and held_xmin_steady's producer rate in
	// events/s. Default 1,000.
	Rate int
	// Duration of end_to_end_latency's and held_xmin_steady's steady load.
	// Default 10s.
	Duration time.Duration
	// Orders is how many create_order transactions write_overhead times per
	// variant. Default 2,000.
	Orders int
	// History are claim_cost_vs_history's dispatched-row counts. Default 10k and 1M.
	History []int
	// ClaimRounds is how many claims each history size times. Default 200.
	ClaimRounds int
	// RelayModes adds relay modes to relay_throughput, end_to_end_latency
	// and held_xmin: "cdc" runs the CDC relay next to the notify relay,
	// which always runs as the reference. Default: notify only.
	RelayModes []string
	// Writers are producer_concurrency's concurrent writer counts. Default 4 and 32.
	Writers []int
	// Rounds is how often producer_concurrency runs each variant. Default 2.
	Rounds int
	// ProducerDuration is one producer_concurrency run. Default 4s.
	ProducerDuration time.Duration
	// ConsumerEvents is how many messages consumer_throughput drains. Default 20,000.
	ConsumerEvents int
	// DrainEvents is how many business transactions end_to_end_drain commits. Default 20,000.
	DrainEvents int
	// DrainWriters is how many goroutines commit end_to_end_drain's
	// transactions. Default 8.
	DrainWriters int
	// ConsumerConns is the database pool of the consumer and relay child
	// processes (FERRY_DATABASE_MAX_CONNS). Default 4.
	ConsumerConns int
	// HeldXminEvents and HeldXminRounds size held_xmin: rounds of events
	// inserted and drained, without and with a long transaction. Default
	// 50,000 and 6.
	HeldXminEvents, HeldXminRounds int
	// HeldXminRelayOnly runs held_xmin_steady without the app's consumer:
	// the relay's messages go to a queue drained by an auto-ack consumer,
	// so that the run measures the dispatch path (commit → broker
	// confirm) on a machine too small to carry the whole app at the rate.
	HeldXminRelayOnly bool
	// ServerSettings are PostgreSQL settings ("name=value") for the
	// servers held_xmin and held_xmin_steady start of their own, added
	// after theirs (so they win): log_autovacuum_min_duration=0, to see
	// what a run's tail was.
	ServerSettings []string
	// ServerLog is a file that receives the log of each server held_xmin
	// and held_xmin_steady start, when the scenario ends (the server's
	// directory is removed then). Default: none kept.
	ServerLog string
	// UpcastIterations are the decodes of each upcast round. Default 2,000.
	UpcastIterations int
	// Binary is the ferry binary the memory scenario starts its relay and
	// consumer processes with. Default: this process's own executable.
	Binary string
}

func (b BenchConfig) withDefaults() BenchConfig {
	if len(b.Scenarios) == 0 {
		b.Scenarios = BenchScenarios
	}
	b.Events = cmp.Or(b.Events, 50_000)
	b.BaselineEvents = cmp.Or(b.BaselineEvents, 5_000)
	b.UpcastIterations = cmp.Or(b.UpcastIterations, 2_000)
	b.HeldXminEvents = cmp.Or(b.HeldXminEvents, 50_000)
	b.HeldXminRounds = cmp.Or(b.HeldXminRounds, 6)
	if len(b.Relays) == 0 {
		b.Relays = []int{1, 2, 4}
	}
	b.BatchSize = cmp.Or(b.BatchSize, pgoutbox.DefaultRelayBatchSize)
	b.Rate = cmp.Or(b.Rate, 1000)
	if b.Duration == 0 {
		b.Duration = 10 * time.Second
	}
	b.Orders = cmp.Or(b.Orders, 2000)
	if len(b.History) == 0 {
		b.History = []int{10_000, 1_000_000}
	}
	b.ClaimRounds = cmp.Or(b.ClaimRounds, 200)
	if len(b.Writers) == 0 {
		b.Writers = []int{4, 32}
	}
	b.Rounds = cmp.Or(b.Rounds, 2)
	b.ConsumerEvents = cmp.Or(b.ConsumerEvents, 20_000)
	b.DrainEvents = cmp.Or(b.DrainEvents, 20_000)
	b.DrainWriters = cmp.Or(b.DrainWriters, 8)
	b.ConsumerConns = cmp.Or(b.ConsumerConns, 4)
	b.ProducerDuration = cmp.Or(b.ProducerDuration, 4*time.Second)
	return b
}

// serverSettingName is a PostgreSQL setting's name (an extension's has a
// dot).
var serverSettingName = regexp.MustCompile(`^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?$`)

func (b BenchConfig) validate() error {
	var errs []error
	for _, s := range b.Scenarios {
		if !slices.Contains(BenchScenarios, s) {
			errs = append(errs, fmt.Errorf("unknown scenario %q (known: %s)", s, strings.Join(BenchScenarios, ", ")))
		}
	}
	for _, n := range b.Relays {
		if n < 1 || n > 64 {
			errs = append(errs, fmt.Errorf("relay count %d must be in [1, 64]", n))
		}
	}
	if b.Events < 1 || b.BaselineEvents < 1 || b.Rate < 1 || b.Orders < 1 || b.ClaimRounds < 1 || b.Duration <= 0 {
		errs = append(errs, errors.New("events, baseline events, rate, orders, claim rounds and duration must be positive"))
	}
	for _, n := range b.Writers {
		if n < 1 || n > 256 {
			errs = append(errs, fmt.Errorf("writer count %d must be in [1, 256]", n))
		}
	}
	if b.ConsumerEvents < 1 || b.DrainEvents < 1 || b.DrainWriters < 1 || b.ConsumerConns < 1 {
		errs = append(errs, errors.New("consumer events, drain events and consumer connections must be positive"))
	}
	if b.Rounds < 1 || b.ProducerDuration <= 0 {
		errs = append(errs, errors.New("producer rounds and duration must be positive"))
	}
	if b.BatchSize < 1 || b.BatchSize > pgoutbox.MaxRelayBatchSize {
		errs = append(errs, fmt.Errorf("batch size must be in [1, %d]", pgoutbox.MaxRelayBatchSize))
	}
	for _, m := range b.RelayModes {
		if m != app.RelayModeNotify && m != app.RelayModeCDC {
			errs = append(errs, fmt.Errorf("relay mode %q: want %s or %s", m, app.RelayModeNotify, app.RelayModeCDC))
		}
	}
	for _, set := range b.ServerSettings {
		if name, _, ok := strings.Cut(set, "="); !ok || !serverSettingName.MatchString(name) {
			errs = append(errs, fmt.Errorf("server setting %q: want name=value (log_autovacuum_min_duration=0)", set))
		}
	}
	for _, h := range b.History {
		if h < 0 {
			errs = append(errs, errors.New("history sizes must not be negative"))
		}
	}
	return errors.Join(errs...)
}

// Bench runs the benchmark scenarios against the servers of cfg, each in a
// schema and namespace of its own that it removes afterwards. Each scenario
// prints one JSON object (one line) on out and a table on human.
func Bench(ctx context.Context, cfg app.Config, bc BenchConfig, out, human io.Writer, logger *slog.Logger) error {
	bc = bc.withDefaults()
	if err := bc.validate(); err != nil {
		return err
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid configuration: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	runs := map[string]func(context.Context, app.Config, BenchConfig, *slog.Logger) (benchReport, error){
		ScenarioRelayThroughput:     benchRelayThroughput,
		ScenarioEndToEnd:            benchEndToEnd,
		ScenarioWriteOverhead:       benchWriteOverhead,
		ScenarioClaimCost:           benchClaimCost,
		ScenarioProducerConcurrency: benchProducerConcurrency,
		ScenarioConsumerThroughput:  benchConsumerThroughput,
		ScenarioEndToEndDrain:       benchEndToEndDrain,
		ScenarioMemory:              benchMemory,
		ScenarioUpcast:              benchUpcast,
		ScenarioHeldXmin:            benchHeldXmin,
		ScenarioHeldXminSteady:      benchHeldXminSteady,
	}
	enc := json.NewEncoder(out)
	for i, name := range bc.Scenarios {
		if i > 0 {
			settle(ctx, cfg)
		}
		fmt.Fprintf(human, "== %s\n", name)
		rep, err := runs[name](ctx, cfg, bc, logger)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		rep.JSON["scenario"] = name
		rep.JSON["host"] = hostFacts()
		if err := enc.Encode(rep.JSON); err != nil {
			return err
		}
		fmt.Fprint(human, rep.Table)
	}
	return nil
}

// settle lets the background work a scenario leaves (checkpoints,
// autovacuum, quorum-queue log truncation) finish before the next one, so
// each scenario starts from a quiet machine.
func settle(ctx context.Context, cfg app.Config) {
	if pool, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, ApplicationName: "ferry-bench-admin"}); err == nil {
		_, _ = pool.Exec(ctx, "CHECKPOINT")
		pool.Close()
	}
	select {
	case <-ctx.Done():
	case <-time.After(3 * time.Second):
	}
}

type benchReport struct {
	JSON  map[string]any
	Table string
}

func hostFacts() map[string]any {
	return map[string]any{"cpus": runtime.NumCPU(), "go": runtime.Version()}
}

// benchSchema is a fresh, migrated schema with a pool on it; drop removes it.
type benchSchema struct {
	name string
	pool *pgxpool.Pool
	db   *sql.DB
	drop func()
}

func newBenchSchema(ctx context.Context, cfg app.Config, maxConns int32) (*benchSchema, error) {
	name := fmt.Sprintf("ferry_bench_%d", time.Now().UnixNano())
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, ApplicationName: "ferry-bench-admin"})
	if err != nil {
		return nil, err
	}
	if err := pgdb.CreateSchema(ctx, admin, name); err != nil {
		admin.Close()
		return nil, err
	}
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: name, ApplicationName: "ferry-bench", MaxConns: maxConns})
	if err != nil {
		admin.Close()
		return nil, err
	}
	db := pgdb.SQLDB(pool)
	s := &benchSchema{name: name, pool: pool, db: db, drop: func() {
		db.Close()
		pool.Close()
		_ = pgdb.DropSchema(context.WithoutCancel(ctx), admin, name)
		admin.Close()
	}}
	if _, err := migrations.Up(ctx, db); err != nil {
		s.drop()
		return nil, err
	}
	// write_overhead measures the example's create_order: its table too.
	if _, err := exmigrations.Set.Up(ctx, db); err != nil {
		s.drop()
		return nil, err
	}
	return s, nil
}

// benchBroker is a namespace with one queue bound to each topic.
type benchBroker struct {
	topo  *rabbit.Topology
	conn  *wamqp.ConnectionWrapper
	queue string
}

func newBenchBroker(cfg app.Config, topics ...string) (*benchBroker, error) {
	rc := cfg.AMQP
	rc.Namespace = fmt.Sprintf("ferrybench%d.", time.Now().UnixNano())
	rc.PublishChannels = max(rc.PublishChannels, 8)
	topo, err := rabbit.NewTopology(rc)
	if err != nil {
		return nil, err
	}
	conn, err := rabbit.Dial(rc, "ferry-bench", watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	b := &benchBroker{topo: topo, conn: conn, queue: "bench.sink"}
	var bindings []rabbit.Binding
	for _, t := range topics {
		bindings = append(bindings, rabbit.Binding{Topic: t, Queue: b.queue})
	}
	if err := topo.Declare(conn.Connection(), bindings...); err != nil {
		conn.Close()
		return nil, err
	}
	return b, nil
}

func (b *benchBroker) depth() (int, error) {
	return rabbit.QueueDepth(b.conn.Connection(), b.topo.QueueName(b.queue))
}

func (b *benchBroker) purge() error { return b.topo.Purge(b.conn.Connection()) }

func (b *benchBroker) close() {
	_ = b.topo.Teardown(b.conn.Connection())
	_ = b.conn.Close()
}

const benchTopic = "bench.event"

// insertEventsSQL writes $2 pending events of topic $1, the size of
// create_order's (payload and headers).
const insertEventsSQL = `INSERT INTO outbox (aggregate_id, topic, payload, headers)
	SELECT (g % 1000)::text, $1,
	       jsonb_build_object('order_id', g, 'user_id', 'user-' || (g % 977), 'amount', 1200, 'currency', 'JPY'),
	       jsonb_build_object('schema_version', '1', 'correlation_id', md5(g::text))
	FROM generate_series(1, $2::int) g`

// preload writes n pending events straight into the outbox: loading is not
// what is measured. Payload and headers are the size of create_order's.
func preload(ctx context.Context, pool *pgxpool.Pool, topic string, n int) error {
	if _, err := pool.Exec(ctx, `TRUNCATE outbox RESTART IDENTITY`); err != nil {
		return fmt.Errorf("truncating outbox: %w", err)
	}
	_, err := pool.Exec(ctx, insertEventsSQL, topic, n)
	if err != nil {
		return fmt.Errorf("preloading %d events: %w", n, err)
	}
	_, err = pool.Exec(ctx, `VACUUM ANALYZE outbox`)
	return err
}

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
	if _, err := pool.Exec(ctx, `UPDATE outbox SET dispatched_at = NULL, attempts = 0`); err != nil {
		return 0, err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
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
				if _, err := pool.Exec(ctx, `UPDATE outbox SET dispatched_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`, ids); err != nil {
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

type latencies []time.Duration

func (l latencies) summary() map[string]float64 {
	if len(l) == 0 {
		return map[string]float64{"count": 0}
	}
	s := slices.Clone(l)
	slices.Sort(s)
	q := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return ms(s[max(0, min(i, len(s)-1))])
	}
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return map[string]float64{
		"count": float64(len(s)), "p50_ms": q(0.50), "p95_ms": q(0.95), "p99_ms": q(0.99),
		"max_ms": ms(s[len(s)-1]), "mean_ms": ms(sum / time.Duration(len(s))),
	}
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }

const benchSeqKey = "bench_seq"

// benchEndToEnd runs end_to_end_latency with the notify relay and then,
// if asked, with the CDC relay, in the same run; the CDC run's numbers go
// under "cdc", next to the notify relay's.
//
// The notify relay's run is made twice, with a route of single messages
// and with a batch route (handlers.Batch defaults); the batch route's
// numbers go under "batch". A third run publishes exactly as the README
// shows (pgx.BeginFunc, PublishTx, nothing after the commit) at a rate
// that leaves the relay idle between events, with the default relay
// configuration: its numbers, under "readme", are what a service that
// never calls Committed gets (the idle relay's probe finds its commits).
func benchEndToEnd(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	rep, err := endToEndOnce(ctx, cfg, bc, app.RelayModeNotify, false, logger)
	if err != nil {
		return rep, err
	}
	settle(ctx, cfg)
	batch, err := endToEndOnce(ctx, cfg, bc, app.RelayModeNotify, true, logger)
	if err != nil {
		return benchReport{}, fmt.Errorf("batch route: %w", err)
	}
	rep.JSON["batch"] = batch.JSON
	settle(ctx, cfg)
	rb := bc
	rb.Rate = min(bc.Rate, readmeRate)
	readme, err := endToEndOnce(ctx, cfg, rb, app.RelayModeNotify, false, logger, publishAsTheREADME)
	if err != nil {
		return benchReport{}, fmt.Errorf("published as the README does: %w", err)
	}
	rep.JSON["readme"] = readme.JSON
	// The same without the idle relay's probe: what the README's path got
	// before it (the poll alone finds such commits).
	settle(ctx, cfg)
	noProbe := cfg
	noProbe.Relay.ProbeInterval = -1
	unprobed, err := endToEndOnce(ctx, noProbe, rb, app.RelayModeNotify, false, logger, publishAsTheREADME)
	if err != nil {
		return benchReport{}, fmt.Errorf("published as the README does, probe off: %w", err)
	}
	rep.JSON["readme_probe_off"] = unprobed.JSON
	rep.Table = "route of single messages: " + rep.Table + "batch route: " + batch.Table +
		fmt.Sprintf("published as the README does (pgx.BeginFunc + PublishTx, no Committed; default relay configuration, %d/s): ", rb.Rate) + readme.Table +
		"the same with FERRY_RELAY_PROBE_INTERVAL=off: " + unprobed.Table
	if !slices.Contains(bc.RelayModes, app.RelayModeCDC) {
		return rep, nil
	}
	settle(ctx, cfg)
	cdc, err := endToEndOnce(ctx, cfg, bc, app.RelayModeCDC, false, logger)
	if err != nil {
		return benchReport{}, fmt.Errorf("cdc: %w", err)
	}
	rep.JSON["cdc"] = cdc.JSON
	rep.Table = "notify relay: " + rep.Table + "cdc relay: " + cdc.Table
	return rep, nil
}

// readmeRate is the README variant's rate: slow enough that the relay is
// idle when each event commits, which is when a missed wake-up shows.
const readmeRate = 50

// publishFunc commits event seq with its business write.
type publishFunc func(ctx context.Context, a *app.App, seq int) error

func endToEndOnce(ctx context.Context, cfg app.Config, bc BenchConfig, mode string, batch bool, logger *slog.Logger, publishWith ...publishFunc) (benchReport, error) {
	h := e2eHooks{publish: benchPublishOne}
	if len(publishWith) > 0 {
		h.publish = publishWith[0]
	}
	return endToEnd(ctx, cfg, bc, mode, batch, logger, h)
}

// e2eHooks are what a variant of end_to_end_latency changes: how an event
// is published, and what happens once the app runs, before the load
// (held_xmin_steady opens its long transaction there: after the
// migrations, whose CREATE INDEX CONCURRENTLY waits for older
// transactions).
type e2eHooks struct {
	publish    publishFunc
	afterStart func(ctx context.Context) (release func(), err error)
	// relayOnly starts the relay without the consumers; an auto-ack
	// consumer on a queue of its own drains what it publishes.
	relayOnly bool
}

func endToEnd(ctx context.Context, cfg app.Config, bc BenchConfig, mode string, batch bool, logger *slog.Logger, h e2eHooks) (benchReport, error) {
	publish := h.publish
	sch, err := newBenchSchema(ctx, cfg, 0)
	if err != nil {
		return benchReport{}, err
	}
	schema := sch.name
	sch.db.Close()
	sch.pool.Close()
	defer sch.drop()

	total := int(float64(bc.Rate) * bc.Duration.Seconds())
	commits := make([]atomic.Int64, total)
	confirms := make([]atomic.Int64, total)
	starts := make([]atomic.Int64, total)
	effects := make([]atomic.Int64, total)
	var handled, recordedN, confirmedN atomic.Int64
	seqOf := func(m *message.Message) (int, bool) {
		i, err := strconv.Atoi(m.Metadata.Get(benchSeqKey))
		return i, err == nil && i >= 0 && i < total
	}
	origin := time.Now()
	since := func() int64 { return int64(time.Since(origin)) }

	c := cfg
	c.RelayMode = mode
	c.DatabaseSchema = schema
	c.DatabaseMaxConns = 24
	c.AdminAddr = "off"
	c.AMQP.Namespace = fmt.Sprintf("ferrybench%d.", time.Now().UnixNano())
	c.Relay.Observer = func(outs []pgoutbox.Outcome) {
		for _, o := range outs {
			if i, ok := seqOf(o.Msg); ok && o.Err == nil && confirms[i].CompareAndSwap(0, int64(o.At.Sub(origin))) {
				confirmedN.Add(1)
			}
		}
	}
	started := func(m *message.Message) {
		if i, ok := seqOf(m); ok && starts[i].CompareAndSwap(0, since()) {
			handled.Add(1)
		}
	}
	route := handlers.Route{Name: "bench.latency", Topic: "bench.e2e", Handler: func(m *message.Message) error { started(m); return nil }}
	if batch {
		route.Handler = nil
		route.Batch = &handlers.Batch{Handler: func(_ context.Context, msgs []*message.Message) error {
			for _, m := range msgs {
				started(m)
			}
			return nil
		}}
	}
	// Right outside the ledger (or the batch): a delivery that returns
	// from there without error has its effect recorded, committed.
	recorded := middleware.Link{Name: "bench-effect-recorded", Middleware: func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if i, ok := seqOf(m); ok && err == nil && effects[i].CompareAndSwap(0, since()) {
				recordedN.Add(1)
			}
			return out, err
		}
	}}
	a, err := app.New(ctx, c, app.Options{Logger: logger, Routes: func(app.Deps) ([]handlers.Route, error) {
		if h.relayOnly {
			// No route: its queue, declared at start, would keep every
			// message with no consumer on it.
			return nil, nil
		}
		return []handlers.Route{route}, nil
	}, Chain: func(ch middleware.Chain) (middleware.Chain, error) {
		return ch.InsertAfter(middleware.LinkRecoverer, recorded)
	}})
	if err != nil {
		return benchReport{}, err
	}
	defer a.Close()
	defer func() { _ = a.Topology().Teardown(a.Broker()) }()
	if h.relayOnly {
		drained, err := drainAutoAck(a, "bench.e2e")
		if err != nil {
			return benchReport{}, err
		}
		defer drained()
	}
	stop, err := a.Start(ctx, app.Components{Relay: true, Consumers: !h.relayOnly})
	if err != nil {
		return benchReport{}, err
	}
	defer stop()
	if h.afterStart != nil {
		release, err := h.afterStart(ctx)
		if err != nil {
			return benchReport{}, err
		}
		defer release()
	}

	// A steady producer: event i is due at origin+i/rate; several workers
	// keep to the schedule when one transaction is slow.
	prodStart := time.Now()
	cpu0, srv0 := readCPU(), readServerCPU()
	interval := time.Second / time.Duration(bc.Rate)
	var next atomic.Int64
	var wg sync.WaitGroup
	var prodErr atomic.Value
	for range 8 {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= total {
					return
				}
				time.Sleep(time.Until(prodStart.Add(time.Duration(i) * interval)))
				if err := publish(ctx, a, i); err != nil {
					prodErr.Store(err)
					return
				}
				commits[i].Store(since())
			}
		})
	}
	wg.Wait()
	produced := time.Since(prodStart)
	cpu1, srv1 := readCPU(), readServerCPU()
	cpuBusy := cpu1.busySince(cpu0)
	perEvent := cpuPerEvent(cpu0, cpu1, srv0, srv1, total, "ferry_process")
	if err, _ := prodErr.Load().(error); err != nil {
		return benchReport{}, err
	}
	// Confirms are waited for too: a publish whose confirm timed out on a
	// loaded machine can still reach the consumer, and the relay sends it
	// again, confirmed, after its backoff (30 s).
	deadline := time.Now().Add(90 * time.Second)
	for (!h.relayOnly && (handled.Load() < int64(total) || recordedN.Load() < int64(total)) || confirmedN.Load() < int64(total)) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := stop(); err != nil {
		return benchReport{}, err
	}
	var cdcStats any
	if all := a.Stats(); all.CDC != nil {
		st := *all.CDC
		cdcStats = map[string]any{"dispatched": st.Dispatched, "left_to_safety_net": st.Left, "skipped": st.Skipped, "streamed_transactions": st.Streamed, "retried_not_yet_visible": st.Retried}
		if _, _, err := pgcdc.DropWhenInactive(ctx, a.Pool(), all.CDCSlot, all.CDCPublication); err != nil {
			return benchReport{}, err
		}
	}
	var toConfirm, toHandler, toEffect latencies
	for i := range total {
		if ef := effects[i].Load(); ef != 0 {
			toEffect = append(toEffect, time.Duration(max(0, ef-commits[i].Load())))
		}
		cm := commits[i].Load()
		if cf := confirms[i].Load(); cf != 0 {
			toConfirm = append(toConfirm, time.Duration(max(0, cf-cm)))
		}
		if st := starts[i].Load(); st != 0 {
			toHandler = append(toHandler, time.Duration(max(0, st-cm)))
		}
	}
	cs, hs, es := toConfirm.summary(), toHandler.summary(), toEffect.summary()
	var tb strings.Builder
	who, got := "producers, relay, consumer", fmt.Sprintf("%d handled", handled.Load())
	if h.relayOnly {
		who, got = "producers, relay, an auto-ack drain", fmt.Sprintf("%d confirmed (relay only)", len(toConfirm))
	}
	fmt.Fprintf(&tb, "%d events at %d/s for %s (achieved %.0f/s), %s, machine CPU %.0f%% busy; CPU per event: PostgreSQL %.0f µs, RabbitMQ %.0f µs, this process (%s) %.0f µs, machine %.0f µs\n",
		total, bc.Rate, bc.Duration, float64(total)/produced.Seconds(), got, 100*cpuBusy,
		perEvent["postgresql"], perEvent["rabbitmq"], who, perEvent["ferry_process"], perEvent["all"])
	fmt.Fprintf(&tb, "%-22s %8s %8s %8s %8s\n", "", "p50 ms", "p95 ms", "p99 ms", "max ms")
	fmt.Fprintf(&tb, "%-22s %8.2f %8.2f %8.2f %8.2f\n", "commit→broker confirm", cs["p50_ms"], cs["p95_ms"], cs["p99_ms"], cs["max_ms"])
	if !h.relayOnly {
		fmt.Fprintf(&tb, "%-22s %8.2f %8.2f %8.2f %8.2f\n", "commit→handler start", hs["p50_ms"], hs["p95_ms"], hs["p99_ms"], hs["max_ms"])
		fmt.Fprintf(&tb, "%-22s %8.2f %8.2f %8.2f %8.2f\n", "commit→effect recorded", es["p50_ms"], es["p95_ms"], es["p99_ms"], es["max_ms"])
	}
	return benchReport{
		JSON: map[string]any{
			"params":                map[string]any{"rate_per_sec": bc.Rate, "duration_sec": bc.Duration.Seconds(), "events": total, "relays": 1, "poll_interval_ms": ms(c.WithDefaults().Relay.PollInterval), "relay_mode": mode, "batch_route": batch, "probe_interval_ms": ms(c.WithDefaults().Relay.ProbeInterval), "relay_only": h.relayOnly},
			"achieved_rate_per_sec": float64(total) / produced.Seconds(),
			"handled":               handled.Load(),
			"cdc_streamer":          cdcStats,
			"commit_to_confirm":     cs,
			"commit_to_handler":     hs,
			"commit_to_effect":      es,
			"machine_busy":          cpuBusy,
			"cpu_us_per_event":      perEvent,
			"targets": map[string]any{
				"commit_to_confirm_p99_ms_max": 50.0, "commit_to_confirm_p99_met": cs["p99_ms"] < 50 && len(toConfirm) == total,
				"commit_to_handler_p99_ms_max": 100.0, "commit_to_handler_p99_met": hs["p99_ms"] < 100 && len(toHandler) == total,
				"commit_to_effect_p99_ms_max": 25.0, "commit_to_effect_p99_met": es["p99_ms"] <= 25 && len(toEffect) == total,
				// The CDC relay's own target (issue: commit→broker p99 ≤ 10 ms at 1,000/s).
				"cdc_commit_to_confirm_p99_ms_max": 10.0, "cdc_commit_to_confirm_p99_met": mode == app.RelayModeCDC && cs["p99_ms"] <= 10 && len(toConfirm) == total,
			},
		},
		Table: tb.String(),
	}, nil
}

// drainAutoAck binds a queue of its own to topic in a's topology and
// consumes it with auto-ack, so that a relay-only run's messages leave the
// broker as fast as they come, at the least cost to the machine.
func drainAutoAck(a *app.App, topic string) (stop func(), err error) {
	const queue = "bench.drain"
	if err := a.Topology().Declare(a.Broker(), rabbit.Binding{Topic: topic, Queue: queue}); err != nil {
		return nil, err
	}
	ch, err := a.Broker().Channel()
	if err != nil {
		return nil, err
	}
	deliveries, err := ch.Consume(a.Topology().QueueName(queue), "ferry-bench-drain", true, false, false, false, nil)
	if err != nil {
		_ = ch.Close()
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range deliveries {
		}
	}()
	return func() { _ = ch.Close(); <-done }, nil
}

// publishAsTheREADME publishes as the README's "Your own service" does:
// a pgx transaction of the caller's, PublishTx in it, and nothing after
// the commit (no Committed, no InTx).
func publishAsTheREADME(ctx context.Context, a *app.App, seq int) error {
	return pgx.BeginFunc(ctx, a.Pool(), func(tx pgx.Tx) error {
		msg, err := pipeline.NewEvent(ctx, strconv.Itoa(seq%1000), map[string]int{"seq": seq})
		if err != nil {
			return err
		}
		msg.Metadata.Set(benchSeqKey, strconv.Itoa(seq))
		return a.Outbox().PublishTx(ctx, pgoutbox.PgxTx(tx), "bench.e2e", msg)
	})
}

func benchPublishOne(ctx context.Context, a *app.App, seq int) error {
	tx, err := a.DB().BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	msg, err := pipeline.NewEvent(ctx, strconv.Itoa(seq%1000), map[string]int{"seq": seq})
	if err != nil {
		return err
	}
	msg.Metadata.Set(benchSeqKey, strconv.Itoa(seq))
	if err := a.Outbox().PublishTx(ctx, tx, "bench.e2e", msg); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	a.Outbox().Committed()
	return nil
}

func benchWriteOverhead(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	sch, err := newBenchSchema(ctx, cfg, 4)
	if err != nil {
		return benchReport{}, err
	}
	defer sch.drop()
	ob, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return benchReport{}, err
	}
	svc, err := orders.NewService(sch.db, ob, logger)
	if err != nil {
		return benchReport{}, err
	}
	// create_order's own statement, without its events: the same text on
	// every bare path.
	const bareOrderSQL = `INSERT INTO orders (user_id, amount, currency, idempotency_key)
		VALUES ($1, $2, $3, $4) ON CONFLICT (idempotency_key) DO NOTHING RETURNING id`
	without := func(i int) error {
		tx, err := sch.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		var id int64
		if err := tx.QueryRowContext(ctx, bareOrderSQL,
			"user-1", 1200, "JPY", fmt.Sprintf("plain-%d", i)).Scan(&id); err != nil {
			return err
		}
		return tx.Commit()
	}
	with := func(i int) error {
		_, err := svc.CreateOrder(ctx, orders.Input{UserID: "user-1", Amount: 1200, Currency: "JPY", IdempotencyKey: fmt.Sprintf("outbox-%d", i)})
		return err
	}
	// The pgx pair: the bare transaction, and the events written with the
	// COMMIT in one round trip (pgoutbox.Outbox.InTx).
	withoutPgx := func(i int) error {
		return pgx.BeginFunc(ctx, sch.pool, func(tx pgx.Tx) error {
			var id int64
			return tx.QueryRow(ctx, bareOrderSQL,
				"user-1", 1200, "JPY", fmt.Sprintf("plain-pgx-%d", i)).Scan(&id)
		})
	}
	withInTx := func(i int) error {
		_, err := orders.CreateOrderInTx(ctx, ob, sch.pool, orders.Input{UserID: "user-1", Amount: 1200, Currency: "JPY", IdempotencyKey: fmt.Sprintf("intx-%d", i)})
		return err
	}
	// The same InTx transaction without its events: what the events
	// themselves cost at the same round-trip count (InTx sends BEGIN with
	// the first statement, which pgx.BeginFunc cannot).
	withoutInTx := func(i int) error {
		return ob.InTx(ctx, sch.pool, func(ctx context.Context, q pgoutbox.Querier, _ *pgoutbox.Pending) error {
			var id int64
			return q.QueryRow(ctx, bareOrderSQL,
				"user-1", 1200, "JPY", fmt.Sprintf("plain-intx-%d", i)).Scan(&id)
		})
	}
	// Warm up every path (connections, plans), then interleave so drift in
	// the machine's load hits all alike.
	for i := range 50 {
		if err := errors.Join(without(-1-i), with(-1-i), withoutPgx(-1-i), withInTx(-1-i), withoutInTx(-1-i)); err != nil {
			return benchReport{}, err
		}
	}
	var lw, lo, lp, li, ln latencies
	variants := [5]struct {
		run func(int) error
		lat *latencies
	}{{with, &lw}, {without, &lo}, {withInTx, &li}, {withoutPgx, &lp}, {withoutInTx, &ln}}
	for i := range bc.Orders {
		for j := range variants {
			v := variants[(i+j)%len(variants)]
			t0 := time.Now()
			if err := v.run(i); err != nil {
				return benchReport{}, err
			}
			*v.lat = append(*v.lat, time.Since(t0))
		}
	}
	sw, so, si, sp, sn := lw.summary(), lo.summary(), li.summary(), lp.summary(), ln.summary()
	ratioP50, ratioMean := sw["p50_ms"]/so["p50_ms"], sw["mean_ms"]/so["mean_ms"]
	inTxP50, inTxMean := si["p50_ms"]/sp["p50_ms"], si["mean_ms"]/sp["mean_ms"]
	eventsP50, eventsMean := si["p50_ms"]/sn["p50_ms"], si["mean_ms"]/sn["mean_ms"]
	var tb strings.Builder
	fmt.Fprintf(&tb, "%-44s %8s %8s %8s\n", "", "p50 ms", "p95 ms", "mean ms")
	for _, r := range []struct {
		name string
		s    map[string]float64
	}{{"create_order with 2 events (database/sql)", sw}, {"create_order without events (database/sql)", so},
		{"create_order with 2 events (InTx)", si}, {"create_order without events (pgx.BeginFunc)", sp},
		{"create_order without events (InTx)", sn}} {
		fmt.Fprintf(&tb, "%-44s %8.3f %8.3f %8.3f\n", r.name, r.s["p50_ms"], r.s["p95_ms"], r.s["mean_ms"])
	}
	fmt.Fprintf(&tb, "overhead, PublishTx on database/sql: %+.0f%% at p50, %+.0f%% on the mean\n", 100*(ratioP50-1), 100*(ratioMean-1))
	fmt.Fprintf(&tb, "overhead, InTx with events vs the bare pgx.BeginFunc transaction: %+.0f%% at p50, %+.0f%% on the mean\n", 100*(inTxP50-1), 100*(inTxMean-1))
	fmt.Fprintf(&tb, "the events alone, InTx with vs without them: %+.0f%% at p50, %+.0f%% on the mean\n", 100*(eventsP50-1), 100*(eventsMean-1))
	return benchReport{
		JSON: map[string]any{
			"params":                  map[string]any{"orders_per_variant": bc.Orders},
			"with_events":             sw,
			"without_events":          so,
			"ratio_p50":               ratioP50,
			"ratio_mean":              ratioMean,
			"in_tx_with_events":       si,
			"pgx_without_events":      sp,
			"in_tx_without_events":    sn,
			"in_tx_ratio_p50":         inTxP50,
			"in_tx_ratio_mean":        inTxMean,
			"in_tx_events_ratio_p50":  eventsP50,
			"in_tx_events_ratio_mean": eventsMean,
			"targets": map[string]any{"overhead_max": 0.25, "overhead_met": ratioP50 <= 1.25,
				"in_tx_overhead_met": inTxP50 <= 1.25, "in_tx_events_overhead_met": eventsP50 <= 1.25},
		},
		Table: tb.String(),
	}, nil
}

func benchClaimCost(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	type row struct {
		History int                `json:"dispatched_rows"`
		Claim   map[string]float64 `json:"claim"`
	}
	var rows []row
	for _, h := range bc.History {
		sch, err := newBenchSchema(ctx, cfg, 2)
		if err != nil {
			return benchReport{}, err
		}
		lat, err := claimRounds(ctx, sch.pool, h, bc)
		sch.drop()
		if err != nil {
			return benchReport{}, err
		}
		rows = append(rows, row{History: h, Claim: lat.summary()})
	}
	first, last := rows[0], rows[len(rows)-1]
	ratio := last.Claim["p50_ms"] / first.Claim["p50_ms"]
	var tb strings.Builder
	fmt.Fprintf(&tb, "%-16s %8s %8s %8s\n", "dispatched rows", "p50 ms", "p95 ms", "p99 ms")
	for _, r := range rows {
		fmt.Fprintf(&tb, "%-16d %8.3f %8.3f %8.3f\n", r.History, r.Claim["p50_ms"], r.Claim["p95_ms"], r.Claim["p99_ms"])
	}
	fmt.Fprintf(&tb, "claim p50 at %d / at %d: %.2fx\n", last.History, first.History, ratio)
	return benchReport{
		JSON: map[string]any{
			"params":                        map[string]any{"history": bc.History, "rounds": bc.ClaimRounds, "batch_size": bc.BatchSize},
			"runs":                          rows,
			"ratio_p50_largest_vs_smallest": ratio,
			"targets":                       map[string]any{"ratio_max": 1.5, "ratio_met": ratio <= 1.5},
		},
		Table: tb.String(),
	}, nil
}

// claimRounds fills the table with history dispatched rows (as a vacuumed
// production table holds them), then times the slow lane's claim query
// (failed and delayed rows: see pgoutbox's lanes) over a fresh batch of
// pending rows, round after round.
func claimRounds(ctx context.Context, pool *pgxpool.Pool, history int, bc BenchConfig) (latencies, error) {
	for done := 0; done < history; done += 1_000_000 {
		n := min(1_000_000, history-done)
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (aggregate_id, topic, payload, headers, created_at, available_at, dispatched_at, attempts)
			SELECT (g % 1000)::text, $1, jsonb_build_object('order_id', g), '{"schema_version":"1"}',
			       now() - interval '1 day', now() - interval '1 day', now() - interval '1 day', 1
			FROM generate_series(1, $2::int) g`, benchTopic, n); err != nil {
			return nil, fmt.Errorf("loading history: %w", err)
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
		return nil, err
	}
	claim := pgoutbox.Table{}.ClaimSQL(false)
	var lat latencies
	for range bc.ClaimRounds {
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (aggregate_id, topic, payload, slow) SELECT g::text, $1, '{}', true FROM generate_series(1, $2::int) g`, benchTopic, bc.BatchSize); err != nil {
			return nil, err
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		t0 := time.Now()
		rows, err := tx.Query(ctx, claim, bc.BatchSize)
		if err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		var ids []int64
		for rows.Next() {
			var (
				id         int64
				uuid       *string
				agg, topic string
				payload    []byte
				headers    map[string]any
				attempts   int
				created    time.Time
				due        time.Time
				shadow     bool
				prev       *int64
			)
			if err := rows.Scan(&id, &uuid, &agg, &topic, &payload, &headers, &attempts, &created, &due, &shadow, &prev); err != nil {
				rows.Close()
				_ = tx.Rollback(ctx)
				return nil, err
			}
			ids = append(ids, id)
		}
		rows.Close()
		lat = append(lat, time.Since(t0))
		if _, err := tx.Exec(ctx, `UPDATE outbox SET dispatched_at = now() WHERE id = ANY($1)`, ids); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, err
		}
	}
	return lat, nil
}

// cpuSample is the first line of /proc/stat: jiffies busy and in total.
type cpuSample struct{ busy, total uint64 }

func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	var s cpuSample
	for i, f := range fields[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		s.total += v
		if i != 3 && i != 4 { // idle, iowait
			s.busy += v
		}
	}
	return s
}

// busySince is the busy share of the CPU between s0 and s (0 where unknown).
func (s cpuSample) busySince(s0 cpuSample) float64 {
	if s.total <= s0.total {
		return 0
	}
	return math.Round(1000*float64(s.busy-s0.busy)/float64(s.total-s0.total)) / 1000
}

// serverCPU is the CPU time (user + system, jiffies of 10 ms) of the
// processes named postgres and beam.smp (RabbitMQ) now alive, and of this
// process: with readCPU, where the machine's time goes during a run.
// Backends that exit between two readings take their time with them, so
// the database's share is a lower bound.
type serverCPU struct{ postgres, rabbitmq, self uint64 }

// cpuPerEvent is the CPU the machine, PostgreSQL, RabbitMQ and this
// process (under self's name) spent per event between two readings, in µs.
func cpuPerEvent(cpu0, cpu1 cpuSample, srv0, srv1 serverCPU, events int, self string) map[string]any {
	// Jiffies are 10 ms: 10,000 µs each.
	per := func(jiffies uint64) float64 { return math.Round(10*float64(jiffies)*10_000/float64(events)) / 10 }
	return map[string]any{"all": per(cpu1.busy - cpu0.busy), "postgresql": per(srv1.postgres - srv0.postgres),
		"rabbitmq": per(srv1.rabbitmq - srv0.rabbitmq), self: per(srv1.self - srv0.self)}
}

func readServerCPU() serverCPU {
	var s serverCPU
	dirs, _ := os.ReadDir("/proc")
	self := strconv.Itoa(os.Getpid())
	for _, d := range dirs {
		if d.Name()[0] < '0' || d.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue
		}
		open, end := strings.IndexByte(string(b), '('), strings.LastIndexByte(string(b), ')')
		if open < 0 || end < open {
			continue
		}
		comm := string(b[open+1 : end])
		fields := strings.Fields(string(b[end+1:]))
		if len(fields) < 13 {
			continue
		}
		utime, _ := strconv.ParseUint(fields[11], 10, 64)
		stime, _ := strconv.ParseUint(fields[12], 10, 64)
		switch {
		case d.Name() == self:
			s.self += utime + stime
		case comm == "postgres":
			s.postgres += utime + stime
		case comm == "beam.smp":
			s.rabbitmq += utime + stime
		}
	}
	return s
}

// orderedOf is the ordered topics a publisher reports, for the relays
// the bench builds by hand.
func orderedOf(pub any) []string {
	if o, ok := pub.(pipeline.Ordering); ok {
		return o.OrderedTopics()
	}
	return nil
}
