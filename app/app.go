package app

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/ferry-dev/ferry/adoption/cutoff"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgconn"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/tools"
	"github.com/ferry-dev/ferry/tools/mcptools"
	"github.com/ferry-dev/ferry/tracing"
)

// ErrMigrationsPending is returned by New when the schema is behind the
// binary and Options.Migrate is off: apply the migrations first (the
// CLI's `migrate up`, or migrations.Set.Up), or set Options.Migrate (the
// CLI's --migrate); the CLI's error names its own command.
var ErrMigrationsPending = errors.New("database migrations are pending")

// Deps is what a route table may use to build its handlers.
type Deps struct {
	Config Config
	Logger *slog.Logger
	// Pool is the PostgreSQL pool (the handlers' ledger transactions come
	// from it; pgledger.TxFromContext hands a handler its own).
	Pool *pgxpool.Pool
	// DB is a database/sql handle over Pool.
	DB *sql.DB
	// Outbox publishes follow-up events; inside a handler, into the ledger
	// transaction: Outbox.PublishTx(ctx, pgoutbox.PgxTx(pgledger.TxFromContext(ctx)), ...).
	Outbox *pgoutbox.Outbox
}

// Options are the application's extension points.
type Options struct {
	// Routes builds the route table: every consumer handler. Required.
	Routes func(Deps) ([]handlers.Route, error)
	// Chain edits the middleware chain around every route, for instance
	// c.InsertAfter(middleware.LinkCorrelation, myLoggingLink) or c.Append(...).
	Chain func(middleware.Chain) (middleware.Chain, error)
	// Migrations are the application's own migration sets, applied after
	// Ferry's (Migrate) and checked at start like them.
	Migrations []migrations.Set
	// HTTP, if set, builds the application's HTTP API, served on
	// Config.HTTPAddr when Components.HTTP is on.
	HTTP func(*App) (http.Handler, error)
	// Tools, if set, builds the application's agent tools. They are served
	// on the API server over MCP (/mcp, streamable HTTP) and as plain JSON
	// (/tools), by `ferry mcp` over stdio, and run in-process with
	// App.Tools.Call; intent_status comes with them.
	Tools func(Deps) ([]tools.Tool, error)
	// Migrate applies pending migrations at start instead of refusing to start.
	Migrate bool
	// Logger receives every log line. Default: NewLogger(cfg, os.Stderr).
	Logger *slog.Logger
	// TracerProvider receives Ferry's spans. Default: an OTLP exporter when
	// the standard OTEL_* variables name an endpoint
	// (OTEL_EXPORTER_OTLP_ENDPOINT, …; see tracing.ExportEnabled), else
	// the global provider.
	TracerProvider trace.TracerProvider
	// Version is reported in ferry status. Default "dev".
	Version string
	// WithoutBroker builds an app that only writes events (a web service
	// placing orders): no broker connection, so no relay and no consumers.
	// The relays declare the topology when they start.
	WithoutBroker bool
}

// ErrNoRoutes is returned by New without Options.Routes: an application
// says what it consumes (an empty table is fine for a relay-only process).
var ErrNoRoutes = errors.New("app: Options.Routes is required (return an empty table for a process without consumers)")

// App is a wired Ferry application.
type App struct {
	cfg    Config
	opts   Options
	logger *slog.Logger

	Pool     *pgxpool.Pool
	DB       *sql.DB
	Outbox   *pgoutbox.Outbox
	Topology *rabbit.Topology
	Relay    *pgoutbox.Relay
	// CDC streams the outbox from the WAL in relay mode "cdc" (nil
	// otherwise); Relay is then its polling safety net.
	CDC         *pgcdc.Streamer
	Ledger      *pgledger.Ledger
	Idempotency *middleware.Idempotency
	Rescheduler *pgoutbox.Rescheduler
	Poison      *pgpoison.Store
	Metrics     *metrics.Metrics
	Routes      []handlers.Route
	// Tools runs the application's agent tools (nil without Options.Tools).
	Tools *tools.Runner
	// Cutoff routes aggregates to the outbox or the legacy path by their
	// creation time (Config.Cutoff), counted in the app's metrics.
	Cutoff *cutoff.Cutoff
	tracer *tracing.Tracer

	pubConn         *wamqp.ConnectionWrapper
	publisher       *wamqp.Publisher
	batchPublisher  *rabbit.BatchPublisher
	poisonPublisher message.Publisher

	// addrs are the bound addresses of the running servers, by name.
	addrs sync.Map
	// shutdownTracing flushes and stops the OTLP exporter New started
	// (nil when none).
	shutdownTracing func(context.Context) error
	// waker sends the relays' wake-ups after commits (notify mode).
	waker *pgoutbox.Waker
}

// APIAddr is the address the HTTP API listens on once Run has bound it
// ("" before, or without one): with FERRY_HTTP_ADDR at port 0, the port
// the system chose.
func (a *App) APIAddr() string { return a.addr("HTTP API") }

// AdminAddr is the admin server's bound address, as APIAddr.
func (a *App) AdminAddr() string { return a.addr("admin") }

func (a *App) addr(name string) string {
	v, _ := a.addrs.Load(name)
	s, _ := v.(string)
	return s
}

// OrderedTopics is the sorted set of topics consumed in per-aggregate order:
// those of routes marked Ordered plus FERRY_ORDERED_TOPICS. The topology
// holds it; the relay and the outbox read it from there.
func (a *App) OrderedTopics() []string { return a.Topology.OrderedTopics() }

// New connects to PostgreSQL and RabbitMQ, checks the schema, declares the
// broker topology of the route table and wires every component. It fails
// fast, with the address, when a server is unreachable.
func New(ctx context.Context, cfg Config, opts Options) (_ *App, err error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration: %w", err)
	}
	if opts.Routes == nil {
		return nil, ErrNoRoutes
	}
	if _, err := MigrationSets(opts); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger, err = NewLogger(cfg, nil)
		if err != nil {
			return nil, err
		}
	}
	var shutdownTracing func(context.Context) error
	if opts.TracerProvider == nil && tracing.ExportEnabled() {
		// The standard OTEL_* variables ask for export: spans go over
		// OTLP, and the provider is the process's global one, so that
		// the application's own instrumentation (an HTTP client's spans)
		// joins the same traces.
		tp, err := tracing.NewOTLPProvider(ctx, "ferry", opts.Version)
		if err != nil {
			return nil, err
		}
		otel.SetTracerProvider(tp)
		// OpenTelemetry reports export failures to its global handler,
		// which writes plain text to stderr: into the application's log
		// instead, in its format (and throttled as every error is).
		logger := opts.Logger
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
			logger.Error("OpenTelemetry: exporting spans failed", "error", err)
		}))
		opts.TracerProvider, shutdownTracing = tp, tp.Shutdown
	}
	a := &App{cfg: cfg, opts: opts, logger: opts.Logger, Metrics: metrics.New(), tracer: tracing.New(opts.TracerProvider), shutdownTracing: shutdownTracing}
	a.Metrics.OutboxTable = cfg.Relay.Table
	switch cfg.RelayMode {
	case RelayModePoll:
		cfg.Relay.PollOnly = true
	case RelayModeCDC:
		// The polling relay stays, slow and out of the stream's way, as the
		// safety net: delayed rows, retries and whatever the stream left.
		cfg.Relay.PollOnly = true
		cfg.Relay.PollInterval = cfg.CDCSafetyNetInterval
		cfg.Relay.MinAge = cfg.CDCSafetyNetMinAge
		cfg.Relay.ProbeInterval = -1 // the stream is the wake-up
	}
	if cfg.Relay.Spans == nil {
		cfg.Relay.Spans = a.tracer
	}
	// The relay reports to the metrics, and to the caller's observer if any.
	if user := cfg.Relay.Observer; user != nil {
		cfg.Relay.Observer = func(o []pgoutbox.Outcome) { a.Metrics.ObserveRelay(o); user(o) }
	} else {
		cfg.Relay.Observer = a.Metrics.ObserveRelay
	}
	defer func() {
		if err != nil {
			a.Close()
		}
	}()

	a.Pool, err = pgconn.Open(ctx, pgconn.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: cfg.DatabaseAppName, MaxConns: cfg.DatabaseMaxConns})
	if err != nil {
		return nil, err
	}
	a.DB = pgconn.SQLDB(a.Pool)
	if a.Cutoff, err = cutoff.New(cfg.Cutoff, a.Metrics.Registry, a.logger); err != nil {
		return nil, err
	}
	if err := a.checkSchema(ctx); err != nil {
		return nil, err
	}

	// The outbox asks the topology (built below, once the route table says
	// which topics are ordered) whether a topic needs aggregate ids.
	// The producer writes in the service's own transactions, on the
	// service's own pool, whose search_path does not hold
	// FERRY_DATABASE_SCHEMA: the table is named with its schema.
	adapter := pgoutbox.SchemaAdapter{Table: qualifiedTable(cfg.Relay.Table, cfg.DatabaseSchema), Ordered: func(topic string) bool { return a.Topology.Ordered(topic) }, MaxDelay: cfg.MaxDelay}
	if a.Outbox, err = pgoutbox.New(adapter, a.logger); err != nil {
		return nil, fmt.Errorf("RelayConfig.Table: %w", err)
	}
	if !cfg.Relay.PollOnly {
		// Wake-ups after the commit, from this process: see pgoutbox.Waker.
		a.waker = pgoutbox.NewWaker(a.Pool, pgoutbox.WakerConfig{Logger: a.logger})
		a.Outbox.SetWaker(a.waker)
	}
	if a.Ledger, err = pgledger.New(a.Pool, pgledger.Config{}, a.logger); err != nil {
		return nil, err
	}
	if a.Idempotency, err = middleware.NewIdempotency(a.Ledger, a.logger); err != nil {
		return nil, err
	}
	if a.Rescheduler, err = pgoutbox.NewRescheduler(a.Pool, a.Outbox); err != nil {
		return nil, err
	}
	if a.poisonPublisher, err = pgpoison.NewPublisher(a.DB); err != nil {
		return nil, err
	}
	if a.Poison, err = pgpoison.NewStore(a.Pool, a.Outbox); err != nil {
		return nil, err
	}

	if a.Routes, err = opts.Routes(Deps{Config: cfg, Logger: a.logger, Pool: a.Pool, DB: a.DB, Outbox: a.Outbox}); err != nil {
		return nil, fmt.Errorf("building routes: %w", err)
	}
	if err := handlers.ValidateRoutes(a.Routes); err != nil {
		return nil, fmt.Errorf("invalid route table: %w", err)
	}
	for _, r := range a.Routes {
		a.Metrics.InitRoutes(r.Name)
	}
	if opts.Tools != nil {
		ts, err := opts.Tools(Deps{Config: cfg, Logger: a.logger, Pool: a.Pool, DB: a.DB, Outbox: a.Outbox})
		if err != nil {
			return nil, fmt.Errorf("building tools: %w", err)
		}
		if a.Tools, err = tools.NewRunner(a.Pool, a.Outbox, ts, a.logger); err != nil {
			return nil, err
		}
	}

	// The ordering unit, derived once: a topic is ordered when a route on it
	// says so or FERRY_ORDERED_TOPICS names it. The topology keeps the set;
	// the relay (through its publisher) and the outbox ask it.
	amqpCfg := cfg.AMQP
	amqpCfg.OrderedTopics = slices.Clone(cfg.AMQP.OrderedTopics)
	for _, r := range a.Routes {
		if r.Ordered {
			amqpCfg.OrderedTopics = append(amqpCfg.OrderedTopics, r.Topic)
		}
	}
	if a.Topology, err = rabbit.NewTopology(amqpCfg); err != nil {
		return nil, fmt.Errorf("FERRY_AMQP_*: %w", err)
	}
	if err := validateBatches(a.Routes, a.Topology); err != nil {
		return nil, fmt.Errorf("invalid route table: %w", err)
	}
	cfg.AMQP = a.Topology.Config()
	a.cfg = cfg
	if opts.WithoutBroker {
		return a, nil
	}
	if a.pubConn, err = rabbit.Dial(cfg.AMQP, "ferry-publisher", a.watermillLogger()); err != nil {
		return nil, err
	}
	if err := a.Topology.Declare(a.pubConn.Connection(), a.bindings()...); err != nil {
		return nil, fmt.Errorf("declaring RabbitMQ topology: %w", err)
	}
	if a.publisher, err = wamqp.NewPublisherWithConnection(a.Topology.PublisherConfig(), a.watermillLogger(), a.pubConn); err != nil {
		return nil, fmt.Errorf("creating RabbitMQ publisher: %w", err)
	}
	if a.batchPublisher, err = rabbit.NewBatchPublisher(a.pubConn, a.Topology); err != nil {
		return nil, err
	}
	relayCfg := cfg.Relay
	relayCfg.OrderedTopics = a.Topology.OrderedTopics()
	if a.Relay, err = pgoutbox.NewRelay(a.Pool, a.batchPublisher, relayCfg, a.logger); err != nil {
		return nil, err
	}
	if a.waker != nil {
		a.waker.OnCommit(a.Relay.Wake) // a relay of this process wakes without a round trip
	}
	if cfg.RelayMode == RelayModeCDC {
		if a.CDC, err = pgcdc.NewStreamer(a.Pool, a.Relay, cfg.Relay.Table, cfg.CDC, a.logger); err != nil {
			return nil, fmt.Errorf("FERRY_CDC_*: %w", err)
		}
		a.CDC.Wake = a.Relay.Wake
		a.Metrics.CDC = a.CDC.Stats
	}
	a.Metrics.Unrouted = a.UnroutedDepth
	a.Metrics.Queues = a.QueueStats
	return a, nil
}

func (a *App) checkSchema(ctx context.Context) error {
	if a.cfg.RelayMode == RelayModeCDC && a.opts.Migrate {
		// Refuse before changing anything: a CDC relay on a server that
		// cannot stream would otherwise leave a migrated schema behind.
		if err := pgcdc.CheckServer(ctx, a.Pool); err != nil {
			return fmt.Errorf("FERRY_RELAY_MODE=cdc: %w", err)
		}
	}
	if a.cfg.DatabaseSchema != "" && a.opts.Migrate {
		if err := pgconn.EnsureSchema(ctx, a.Pool, a.cfg.DatabaseSchema); err != nil {
			return err
		}
	}
	sets, err := MigrationSets(a.opts)
	if err != nil {
		return err
	}
	for _, set := range sets {
		pending, err := set.Pending(ctx, a.DB)
		if err != nil {
			return err
		}
		if !pending {
			continue
		}
		if !a.opts.Migrate {
			return fmt.Errorf("%w (set %s)", ErrMigrationsPending, set.Name)
		}
		n, err := set.Up(ctx, a.DB)
		if err != nil {
			return err
		}
		a.logger.Info("applied database migrations", "set", set.Name, "count", n, "schema", a.cfg.DatabaseSchema)
	}
	return nil
}

// MigrationSets are Ferry's migrations followed by the application's
// (opts.Migrations), each checked: `ferry migrate` and New use the same list.
func MigrationSets(opts Options) ([]migrations.Set, error) {
	sets := []migrations.Set{migrations.Library}
	for _, s := range opts.Migrations {
		if err := s.Validate(); err != nil {
			return nil, fmt.Errorf("Options.Migrations: %w", err)
		}
		if s.VersionTable == migrations.VersionTable {
			return nil, fmt.Errorf("Options.Migrations: set %q uses Ferry's own version table %s", s.Name, s.VersionTable)
		}
		sets = append(sets, s)
	}
	return sets, nil
}

// bindings is the broker topology of the route table.
func (a *App) bindings() []rabbit.Binding {
	var b []rabbit.Binding
	for _, r := range a.Routes {
		b = append(b, rabbit.Binding{Topic: r.Topic, Queue: r.Name})
	}
	return b
}

// watermillLogger bridges to slog once; Watermill's Info lines (handler
// started, connection opened) are Debug here, its errors stay errors.
func (a *App) watermillLogger() watermill.LoggerAdapter {
	return watermill.NewSlogLoggerWithLevelMapping(a.logger, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})
}

// Broker is the publisher's broker connection (nil WithoutBroker), for
// tools that inspect, purge or tear down the topology.
func (a *App) Broker() *amqp.Connection {
	if a.pubConn == nil {
		return nil
	}
	return a.pubConn.Connection()
}

// UnroutedDepth is how many messages wait in the broker's unrouted queue
// (published to a topic no route consumes); they need a human.
func (a *App) UnroutedDepth(context.Context) (int, error) {
	if a.pubConn == nil {
		return 0, errors.New("app: no broker connection (built WithoutBroker)")
	}
	return rabbit.QueueDepth(a.pubConn.Connection(), a.Topology.QueueName(rabbit.UnroutedName))
}

// QueueStats inspects the queues of the route table (each partition of an
// ordered route, the one queue of another): messages ready and consumers.
// A queue with messages and no consumer is where messages wait unseen.
func (a *App) QueueStats(context.Context) ([]rabbit.QueueStat, error) {
	if a.pubConn == nil {
		return nil, errors.New("app: no broker connection (built WithoutBroker)")
	}
	return a.QueueStatsOn(a.pubConn.Connection())
}

// QueueStatsOn is QueueStats over conn, for an app built WithoutBroker
// (ferry status reads the queues without declaring anything). A queue not
// declared yet is left out: no consumer of it has started.
func (a *App) QueueStatsOn(conn *amqp.Connection) ([]rabbit.QueueStat, error) {
	out := []rabbit.QueueStat{}
	seen := map[string]bool{}
	for _, r := range a.Routes {
		for _, sub := range a.subscriptions(r) {
			if seen[sub.Queue] {
				continue
			}
			seen[sub.Queue] = true
			st, err := rabbit.QueueStats(conn, sub.Queue)
			switch {
			case rabbit.IsQueueMissing(err):
				continue
			case err != nil:
				return out, err
			}
			out = append(out, st)
		}
	}
	return out, nil
}

// Publisher is watermill-amqp's confirmed publisher on Ferry's topology
// (one confirm per message), for direct publishing to unordered topics.
func (a *App) Publisher() message.Publisher { return a.publisher }

// BatchPublisher is the relay's publisher: pipelined confirms, partition routing.
func (a *App) BatchPublisher() *rabbit.BatchPublisher { return a.batchPublisher }

// Components selects what Run runs.
type Components struct {
	Relay     bool
	Consumers bool
	HTTP      bool
	// Pruner prunes the outbox and the ledger every Retention.Interval.
	Pruner bool
}

// All runs every component in one process.
var All = Components{Relay: true, Consumers: true, HTTP: true, Pruner: true}

// Prune removes dispatched outbox rows and ledger rows past their retention.
func (a *App) Prune(ctx context.Context) ([]pgretention.Result, error) {
	r := a.cfg.Retention
	out, err := pgretention.Prune(ctx, a.Pool, pgretention.Outbox, pgretention.Options{OlderThan: r.Outbox, BatchSize: r.BatchSize, Archive: r.ArchiveOutbox, Table: a.cfg.Relay.Table})
	if err != nil {
		return nil, err
	}
	led, err := pgretention.Prune(ctx, a.Pool, pgretention.Ledger, pgretention.Options{OlderThan: r.Ledger, BatchSize: r.BatchSize})
	if err != nil {
		return []pgretention.Result{out}, err
	}
	calls, err := pgretention.Prune(ctx, a.Pool, pgretention.ToolCalls, pgretention.Options{OlderThan: r.ToolCalls, BatchSize: r.BatchSize})
	if err != nil {
		return []pgretention.Result{out, led}, err
	}
	return []pgretention.Result{out, led, calls}, nil
}

// runPruner prunes at start and every interval; a failed prune is logged
// and tried again next time.
func (a *App) runPruner(ctx context.Context) error {
	t := time.NewTicker(a.cfg.Retention.Interval)
	defer t.Stop()
	for {
		res, err := a.Prune(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			a.logger.Error("pruning failed", "error", err)
		}
		for _, r := range res {
			if r.Removed > 0 {
				a.logger.Info("pruned", "target", r.Target, "removed", r.Removed, "cutoff", r.Cutoff, "archived", r.Archive)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// NewRouter builds Ferry's own consumer router: Watermill's router metrics
// router-wide, and the route table mounted on it (see Mount). The returned
// closer releases the consumers' connection once the router has stopped.
func (a *App) NewRouter() (*message.Router, io.Closer, error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: a.cfg.ShutdownTimeout}, a.watermillLogger())
	if err != nil {
		return nil, nil, err
	}
	// Watermill's own router metrics (handler execution time, publish and
	// subscribe counts) go to the same registry; added first, so outermost.
	wmetrics.NewPrometheusMetricsBuilder(a.Metrics.Registry, "", "").AddPrometheusRouterMetrics(router)
	conn, err := a.Mount(router)
	if err != nil {
		return nil, nil, err
	}
	return router, conn, nil
}

// Chain is the middleware chain every route runs in: the default chain
// wired to this app's ledger, poison store, retries, metrics and tracing,
// as edited by Options.Chain.
func (a *App) Chain() (middleware.Chain, error) {
	durable := a.cfg.DurableRetry
	durable.Scheduler = a.Rescheduler
	if durable.Holds == nil {
		durable.Holds = pgstatus.PartitionHolds{Pool: a.Pool}
	}
	chain, err := middleware.DefaultChain(middleware.ChainConfig{
		Poison:         middleware.PoisonConfig{Publisher: a.poisonPublisher},
		DurableRetry:   durable,
		Retry:          a.cfg.Retry,
		Idempotency:    a.Idempotency,
		Logger:         a.logger,
		Recorder:       a.Metrics,
		Tracing:        a.tracer.Consumer,
		TracingAttempt: a.tracer.Attempt,
	})
	if err != nil {
		return nil, err
	}
	if a.opts.Chain != nil {
		if chain, err = a.opts.Chain(chain); err != nil {
			return nil, fmt.Errorf("editing middleware chain: %w", err)
		}
	}
	return chain, nil
}

// Mount adds the route table to router, a Watermill router of the caller's
// (with middleware and handlers of its own) or Ferry's: every route gets
// Ferry's chain (Chain) and its own middleware, and consumes its queue, or
// one queue per partition for an ordered topic, as the topology says. Mount
// adds nothing router-wide.
//
// The consumers share one broker connection; close it after the router has
// stopped.
func (a *App) Mount(router *message.Router) (io.Closer, error) {
	if router == nil {
		return nil, errors.New("app: Mount needs a router")
	}
	if a.opts.WithoutBroker {
		return nil, errors.New("app: an app built WithoutBroker has no consumers to mount")
	}
	chain, err := a.Chain()
	if err != nil {
		return nil, err
	}
	mws := chain.Middlewares()
	// New declared the topology already (an app WithoutBroker has no
	// consumers to mount), and each subscriber declares its own queue.
	conn, err := rabbit.Dial(a.cfg.AMQP, "ferry-consumer", a.watermillLogger())
	if err != nil {
		return nil, err
	}
	for _, r := range a.Routes {
		if r.Batch != nil {
			if err := a.mountBatch(router, conn, chain, r); err != nil {
				conn.Close()
				return nil, err
			}
			continue
		}
		// An ordered route consumes one queue per partition, each its own
		// router handler ("<route>@<k>"), so order holds per partition.
		for _, s := range a.Topology.Subscriptions(r.Name, r.Topic) {
			sub, err := a.consumer(conn, s, 1)
			if err != nil {
				conn.Close()
				return nil, fmt.Errorf("subscribing %s to %s: %w", s.Name, r.Topic, err)
			}
			h := router.AddConsumerHandler(s.Name, r.Topic, sub, r.Handler)
			h.AddMiddleware(mws...)
			h.AddMiddleware(r.Middleware...)
		}
	}
	return conn, nil
}

// consumer is the consumer of one of a route's queues. A stop drains it
// for up to FERRY_SHUTDOWN_TIMEOUT (the router's own bound): a deploy
// lets handlers finish and settle what they hold, so none runs twice, and
// what is left goes back first in line (rabbit.ConsumerConfig).
func (a *App) consumer(conn *wamqp.ConnectionWrapper, s rabbit.Subscription, inFlight int) (*rabbit.Consumer, error) {
	return rabbit.NewConsumer(conn, a.Topology, s, rabbit.ConsumerConfig{InFlight: inFlight, DrainTimeout: a.cfg.ShutdownTimeout}, a.watermillLogger())
}

// validateBatches checks the batch routes against the topology: a topic
// ordered by another route or FERRY_ORDERED_TOPICS cannot be batched
// either, and the batching itself must be valid.
func validateBatches(routes []handlers.Route, topo *rabbit.Topology) error {
	var errs []error
	for _, r := range routes {
		if r.Batch == nil {
			continue
		}
		if topo.Ordered(r.Topic) {
			errs = append(errs, fmt.Errorf("route %q is batched but its topic %q is ordered (by another route or FERRY_ORDERED_TOPICS): a batch keeps no order", r.Name, r.Topic))
		}
		if err := batchConfig(r).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("route %q: %w", r.Name, err))
		}
	}
	return errors.Join(errs...)
}

func batchConfig(r handlers.Route) middleware.BatchConfig {
	return middleware.BatchConfig{MaxSize: r.Batch.MaxSize, MaxWait: r.Batch.MaxWait}
}

// subscriptions are the consumers route r runs: the topology's, or one for
// a batch route, which holds many deliveries on one channel instead of one
// each on FERRY_AMQP_CONSUMERS channels (measured: RabbitMQ spent 266–276
// µs per message at 1,000/s with one channel against 359–398 with eight:
// deliveries and acks share frames).
func (a *App) subscriptions(r handlers.Route) []rabbit.Subscription {
	if r.Batch != nil {
		return []rabbit.Subscription{a.Topology.Subscription(r.Name)}
	}
	return a.Topology.Subscriptions(r.Name, r.Topic)
}

// mountBatch mounts a batch route: its consumer (rabbit.Consumer) holds
// two batches' worth of deliveries, acked many at a time, and one Batcher, shared by
// them, takes the place of the handler and of the chain's idempotency link.
func (a *App) mountBatch(router *message.Router, conn *wamqp.ConnectionWrapper, chain middleware.Chain, r handlers.Route) error {
	batcher, err := middleware.NewBatcher(a.Idempotency, a.Ledger, r.Batch.Handler, batchConfig(r))
	if err != nil {
		return fmt.Errorf("route %q: %w", r.Name, err)
	}
	mws := chain.Without(middleware.LinkIdempotency).Middlewares()
	// Twice a batch in hand: one batch fills while the one before commits;
	// more only costs memory.
	inFlight := 2 * batchConfig(r).WithDefaults().MaxSize
	for _, s := range a.subscriptions(r) {
		sub, err := a.consumer(conn, s, inFlight)
		if err != nil {
			return fmt.Errorf("subscribing %s to %s: %w", s.Name, r.Topic, err)
		}
		h := router.AddConsumerHandler(s.Name, r.Topic, sub, func(msg *message.Message) error {
			_, err := batcher.Handler(msg)
			return err
		})
		h.AddMiddleware(mws...)
		h.AddMiddleware(r.Middleware...)
	}
	return nil
}

// Run runs the selected components until ctx is done or one fails.
// ready, if not nil, is closed once the consumers (if any) are consuming and
// the HTTP API (if any) is listening.
//
// Everything that can fail at start (binding the admin and API ports,
// building the router and the HTTP API, registering the heartbeat) is done
// before anything runs: a failed start leaves no heartbeat row behind and
// no goroutine working on a pool that is being closed.
func (a *App) Run(ctx context.Context, what Components, ready chan<- struct{}) (err error) {
	if a.opts.WithoutBroker && (what.Relay || what.Consumers) {
		return errors.New("an app built WithoutBroker runs neither relay nor consumers")
	}
	if what == (Components{HTTP: true}) && a.opts.HTTP == nil && a.Tools == nil {
		return errors.New("this application has no HTTP API and no agent tools to serve (Options.HTTP, Options.Tools)")
	}
	var (
		servers []*server
		router  *message.Router
		conn    io.Closer
	)
	defer func() {
		if err != nil {
			for _, s := range servers {
				_ = s.ln.Close()
			}
			if conn != nil {
				_ = conn.Close()
			}
		}
	}()
	if a.cfg.AdminAddr != "off" {
		s, err := a.listen("admin", a.cfg.AdminAddr, a.AdminHandler())
		if err != nil {
			return err
		}
		servers = append(servers, s)
		if !s.loopback() {
			a.logger.Warn("the admin server listens beyond loopback: /metrics and /readyz answer anyone who can reach it; firewall it or keep FERRY_ADMIN_ADDR on 127.0.0.1",
				"addr", s.ln.Addr().String())
		}
	}
	if what.HTTP && (a.opts.HTTP != nil || a.Tools != nil) {
		h, err := a.APIHandler()
		if err != nil {
			return err
		}
		s, err := a.listen("HTTP API", a.cfg.HTTPAddr, h)
		if err != nil {
			return err
		}
		servers = append(servers, s)
		if a.Tools != nil && a.cfg.MCPToken == "" && !s.loopback() {
			a.logger.Warn("the agent tool endpoints /mcp and /tools listen beyond loopback without a token: set FERRY_MCP_TOKEN",
				"addr", s.ln.Addr().String())
		}
	}
	if what.Consumers {
		if router, conn, err = a.NewRouter(); err != nil {
			return err
		}
	}
	if what.Relay && a.CDC != nil {
		// A server that cannot stream (wal_level, version, no table) fails
		// the start; an outage later is waited out by the streamer.
		if err := a.CDC.Prepare(ctx); err != nil {
			return fmt.Errorf("CDC relay: %w", err)
		}
		a.Metrics.CDCSlot = a.CDC.Slot()
	}
	var hb *pgstatus.Heartbeat
	if what.Relay || what.Consumers {
		if hb, err = pgstatus.NewHeartbeat(ctx, a.Pool, watermill.NewShortUUID(), what.names(), a.version()); err != nil {
			return err
		}
	}

	g, ctx := errgroup.WithContext(ctx)
	var waits []<-chan struct{}
	if a.waker != nil {
		g.Go(func() error { return a.waker.Run(ctx) })
	}
	if hb != nil {
		hb.Counters = a.Metrics.Counters
		g.Go(func() error { hb.Run(ctx, pgstatus.DefaultHeartbeatInterval); return nil })
	}
	if what.Relay {
		g.Go(func() error { return a.Relay.Run(ctx) })
		if a.CDC != nil {
			g.Go(func() error { return a.CDC.Run(ctx) })
		}
	}
	if what.Pruner {
		g.Go(func() error { return a.runPruner(ctx) })
	}
	g.Go(func() error { a.Metrics.RunRefresher(ctx, a.Pool, a.cfg.MetricsRefresh, a.logger); return nil })
	for _, s := range servers {
		s.run(ctx, g, a.cfg.ShutdownTimeout)
		a.addrs.Store(s.name, s.ln.Addr().String())
		a.logger.Info(s.name+" listening", "addr", s.ln.Addr().String())
	}
	if router != nil {
		waits = append(waits, router.Running())
		g.Go(func() error {
			defer conn.Close()
			if err := router.Run(ctx); err != nil {
				return fmt.Errorf("consumer router: %w", err)
			}
			return nil
		})
		consumers := 0 // router.Handlers() races with the running router
		for _, r := range a.Routes {
			consumers += len(a.subscriptions(r))
		}
		g.Go(func() error {
			select {
			case <-router.Running():
				a.logger.Info("consumers started", "routes", len(a.Routes), "consumers", consumers)
			case <-ctx.Done():
			}
			return nil
		})
	}
	if ready != nil {
		go func() {
			for _, w := range waits {
				select {
				case <-w:
				case <-ctx.Done():
					return
				}
			}
			close(ready)
		}()
	}
	return g.Wait()
}

// APIHandler is what the API server serves: the application's HTTP API
// (Options.HTTP) and, with Options.Tools, the agent tools over MCP at /mcp
// (streamable HTTP) and as plain JSON at /tools (see tools.HTTPHandler).
// With FERRY_MCP_TOKEN set, every one of them needs it, the application's
// own routes too (when there are tools). The server Run starts also
// refuses unknown Host names (FERRY_HTTP_ALLOWED_HOSTS) and browsers'
// cross-site state-changing requests.
func (a *App) APIHandler() (http.Handler, error) {
	var app http.Handler
	if a.opts.HTTP != nil {
		h, err := a.opts.HTTP(a)
		if err != nil {
			return nil, fmt.Errorf("building the HTTP API: %w", err)
		}
		app = h
	}
	if a.Tools == nil {
		if app == nil {
			return nil, errors.New("app: no HTTP API and no tools to serve")
		}
		return app, nil
	}
	mcpHandler, err := mcptools.HTTPHandler(a.Tools, mcptools.HTTPOptions{Token: a.cfg.MCPToken, Logger: a.logger,
		SessionTimeout: a.cfg.MCPSessionTimeout, MaxSessions: a.cfg.MCPMaxSessions,
		Implementation: &mcp.Implementation{Name: "ferry", Version: a.version()}})
	if err != nil {
		return nil, fmt.Errorf("FERRY_MCP_TOKEN: %w", err)
	}
	var plain http.Handler = tools.HTTPHandler(a.Tools, a.logger)
	open := app // the application's health checks: never behind the token
	if a.cfg.MCPToken != "" {
		// The application's routes follow the tools' rule: a plain POST
		// places the same order an agent's tool call does.
		plain = a.bearer(a.cfg.MCPToken, "FERRY_MCP_TOKEN", plain)
		if app != nil {
			app = a.bearer(a.cfg.MCPToken, "FERRY_MCP_TOKEN", app)
		}
	}
	mux := http.NewServeMux()
	mux.Handle("/mcp", mcpHandler)
	mux.Handle("/tools", plain)
	mux.Handle("/tools/", plain)
	if app != nil {
		mux.Handle("/", app)
		// A probe (a load balancer, Kubernetes) has no token, and a
		// health answer says nothing a token protects.
		mux.Handle("GET /healthz", open)
		mux.Handle("GET /readyz", open)
	}
	return mux, nil
}

// server is an HTTP server whose port is bound and that is not running yet.
type server struct {
	name string
	ln   net.Listener
	srv  *http.Server
}

// listen binds addr for h, with the configured bounds on slow and idle
// clients and on the connections held at once.
func (a *App) listen(name, addr string, h http.Handler) (*server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s: listening on %s: %w", name, addr, err)
	}
	c := a.cfg.HTTPServer
	guard := newConnGuard(ln, c.MaxConns, c.MaxConnsPerClient)
	s := &server{name: name, ln: guard}
	s.srv = &http.Server{
		ConnState:         guard.track,
		ConnContext:       withConn,
		Handler:           guard.minBodyRate(guardHosts(a.allowedHosts(s), h), c.MinBodyRate, c.ReadHeaderTimeout, c.ReadTimeout),
		ReadHeaderTimeout: c.ReadHeaderTimeout,
		ReadTimeout:       c.ReadTimeout,
		WriteTimeout:      c.WriteTimeout,
		IdleTimeout:       c.IdleTimeout,
		MaxHeaderBytes:    c.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(a.logger.Handler(), slog.LevelDebug),
	}
	return s, nil
}

func (s *server) loopback() bool {
	tcp, ok := s.ln.Addr().(*net.TCPAddr)
	return ok && tcp.IP.IsLoopback()
}

// run serves in g until ctx ends, then shuts the server down gracefully.
func (s *server) run(ctx context.Context, g *errgroup.Group, shutdown time.Duration) {
	g.Go(func() error {
		if err := s.srv.Serve(s.ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdown)
		defer cancel()
		return s.srv.Shutdown(sctx)
	})
}

func (a *App) version() string {
	if a.opts.Version != "" {
		return a.opts.Version
	}
	return "dev"
}

func (c Components) names() []string {
	var n []string
	for _, x := range []struct {
		on   bool
		name string
	}{{c.Relay, "relay"}, {c.Consumers, "consumers"}, {c.HTTP, "http"}, {c.Pruner, "pruner"}} {
		if x.on {
			n = append(n, x.name)
		}
	}
	return n
}

// Start runs the selected components in the background and returns once
// they are ready (see Run). stop ends them and returns Run's error; it may
// be called more than once, so it can be deferred and called early.
func (a *App) Start(ctx context.Context, what Components) (stop func() error, err error) {
	runCtx, cancel := context.WithCancel(ctx)
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- a.Run(runCtx, what, ready) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	select {
	case <-ready:
		return stop, nil
	case err := <-done:
		once.Do(func() { cancel(); runErr = err })
		return nil, err
	case <-ctx.Done():
		_ = stop()
		return nil, ctx.Err()
	}
}

// qualifiedTable names the outbox table with the schema it lives in when
// FERRY_DATABASE_SCHEMA is set and the table has none.
func qualifiedTable(table, schema string) string {
	if table == "" {
		table = pgoutbox.DefaultTable
	}
	if schema == "" || strings.Contains(table, ".") {
		return table
	}
	return schema + "." + table
}

// TraceHTTP wraps an HTTP handler of the application's API so that the
// request's W3C trace context and X-Correlation-ID reach the events it
// publishes (and answers with the correlation id).
func (a *App) TraceHTTP(route string, h http.Handler) http.Handler { return a.tracer.HTTP(route, h) }

// Close releases every connection. It is safe after a failed New.
func (a *App) Close() error {
	var errs []error
	if a.batchPublisher != nil {
		errs = append(errs, a.batchPublisher.Close())
	}
	if a.publisher != nil {
		errs = append(errs, a.publisher.Close())
	}
	if a.pubConn != nil {
		errs = append(errs, a.pubConn.Close())
	}
	if a.DB != nil {
		errs = append(errs, a.DB.Close())
	}
	if a.Pool != nil {
		a.Pool.Close()
	}
	if a.shutdownTracing != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs = append(errs, a.shutdownTracing(ctx))
		cancel()
	}
	return errors.Join(errs...)
}

// Config returns the configuration the app runs with (defaults applied).
func (a *App) Config() Config { return a.cfg }
