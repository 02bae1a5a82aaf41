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
	"regexp"
	"runtime"
	"slices"
	"strings"
	"time"

	exmigrations "github.com/ferry-dev/ferry/examples/orders/migrations"

	"github.com/ferry-dev/ferry/app"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
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
	ScenarioConsumerThroughput, ScenarioEndToEndDrain, ScenarioUpcast, ScenarioHeldXmin, ScenarioHeldXminSteady, ScenarioIdleCost, ScenarioPoisonDiscard, ScenarioSearchLoad, ScenarioTenants}

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
	// DiscardRows is how many poisoned messages poison_discard discards.
	// Default PoisonDiscardRows (200,000).
	DiscardRows int
	// SearchRows is the dispatched history search_load's searches read.
	// Default 10,000,000.
	SearchRows int
	// Tenants is how many tenants (schemas) tenants serves. Default 100.
	Tenants int
	// TenantBacklog is the noisy tenant's backlog in tenants. Default
	// 1,000,000.
	TenantBacklog int
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
	b.DiscardRows = cmp.Or(b.DiscardRows, PoisonDiscardRows)
	b.SearchRows = cmp.Or(b.SearchRows, 10_000_000)
	b.Tenants = cmp.Or(b.Tenants, 100)
	b.TenantBacklog = cmp.Or(b.TenantBacklog, 1_000_000)
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
	if b.Tenants < 2 || b.Tenants > 1000 || b.TenantBacklog < 1 {
		errs = append(errs, errors.New("tenants must be in [2, 1000] (one noisy, the others quiet) and the tenant backlog positive"))
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
		ScenarioIdleCost:            benchIdleCost,
		ScenarioPoisonDiscard:       benchPoisonDiscard,
		ScenarioSearchLoad:          benchSearchLoad,
		ScenarioTenants:             benchTenants,
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

// newAppSchema is a migrated bench schema for an app of the scenario's
// own to run on: its name, and its removal.
func newAppSchema(ctx context.Context, cfg app.Config) (string, func(), error) {
	sch, err := newBenchSchema(ctx, cfg, 0)
	if err != nil {
		return "", nil, err
	}
	sch.db.Close()
	sch.pool.Close()
	return sch.name, sch.drop, nil
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
var insertEventsSQL = `INSERT INTO ` + outboxSQL + ` (aggregate_id, topic, payload, headers)
	SELECT (g % 1000)::text, $1,
	       jsonb_build_object('order_id', g, 'user_id', 'user-' || (g % 977), 'amount', 1200, 'currency', 'JPY'),
	       jsonb_build_object('schema_version', '1', 'correlation_id', md5(g::text))
	FROM generate_series(1, $2::int) g`

// preload writes n pending events straight into the outbox: loading is not
// what is measured. Payload and headers are the size of create_order's.
func preload(ctx context.Context, pool *pgxpool.Pool, topic string, n int) error {
	if _, err := pool.Exec(ctx, `TRUNCATE `+outboxSQL+` RESTART IDENTITY`); err != nil {
		return fmt.Errorf("truncating outbox: %w", err)
	}
	_, err := pool.Exec(ctx, insertEventsSQL, topic, n)
	if err != nil {
		return fmt.Errorf("preloading %d events: %w", n, err)
	}
	_, err = pool.Exec(ctx, `VACUUM ANALYZE `+outboxSQL)
	return err
}

// orderedOf is the ordered topics a publisher reports, for the relays
// the bench builds by hand.
func orderedOf(pub any) []string {
	if o, ok := pub.(pipeline.Ordering); ok {
		return o.OrderedTopics()
	}
	return nil
}
