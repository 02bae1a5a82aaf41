package app

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferry-dev/ferry/adoption/cutoff"
	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgparked"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/tenancy"
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
	Tools func(Deps) ([]agenttools.Tool, error)
	// Events are the application's event types with their versions
	// (evolve.New): `ferry schema check` compares them with the recorded
	// snapshot, and their names must be unique. Handlers decode through
	// them with handlers.Evolving.
	Events []evolve.Schema
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

	// The parts New wired, unexported so that none can be swapped after
	// New: what a service needs is offered through methods below.
	pool        *pgxpool.Pool
	db          *sql.DB
	outbox      *pgoutbox.Outbox
	topology    *rabbit.Topology
	relay       *pgoutbox.Relay
	cdc         *pgcdc.Streamer // relay mode "cdc" only; relay is then its safety net
	ledger      *pgledger.Ledger
	idempotency *middleware.Idempotency
	rescheduler *pgoutbox.Rescheduler
	pauses      *middleware.PauseWatch // the pause link's and the consumers' one reader
	poison      *pgpoison.Store
	metrics     *metrics.Metrics
	routes      []handlers.Route
	tools       *agenttools.Runner // nil without Options.Tools
	cutoff      *cutoff.Cutoff
	tracer      *tracing.Tracer

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
	// fleet relays the tenants' outboxes and ledgers handles their events
	// in their databases (FERRY_TENANTS); nil otherwise.
	fleet   *tenancy.Fleet
	ledgers *tenancy.Ledgers
	parking *tenancy.Parking
	// tenantOutbox writes into the outbox of the tenant whose transaction
	// it is given (its table names no schema).
	tenantOutbox *pgoutbox.Outbox
}

// ValidateEvents checks Options.Events: no nil entry, each name once.
func ValidateEvents(events []evolve.Schema) error {
	var errs []error
	seen := map[string]bool{}
	for i, e := range events {
		switch {
		case e == nil || reflect.ValueOf(e).Kind() == reflect.Pointer && reflect.ValueOf(e).IsNil():
			errs = append(errs, fmt.Errorf("Options.Events[%d] is nil (evolve.New returned an error?)", i))
		case seen[e.Name()]:
			errs = append(errs, fmt.Errorf("Options.Events: event type %q is listed twice", e.Name()))
		default:
			seen[e.Name()] = true
		}
	}
	return errors.Join(errs...)
}

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
	if err := ValidateEvents(opts.Events); err != nil {
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
	a := &App{cfg: cfg, opts: opts, logger: opts.Logger, metrics: metrics.New(), tracer: tracing.New(opts.TracerProvider), shutdownTracing: shutdownTracing}
	a.metrics.OutboxTable = cfg.Relay.Table
	a.metrics.OutboxRetention, a.metrics.LedgerRetention, a.metrics.PruneInterval = cfg.Retention.Outbox, cfg.Retention.Ledger, cfg.Retention.Interval
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
	if cfg.Relay.MarkEachRow == nil {
		cfg.Relay.MarkEachRow = func(ctx context.Context) (bool, error) { return pgstatus.EarlierRelaysAlive(ctx, a.pool) }
	}
	// The relay reports to the metrics, and to the caller's observer if any.
	if user := cfg.Relay.Observer; user != nil {
		cfg.Relay.Observer = func(o []pgoutbox.Outcome) { a.metrics.ObserveRelay(o); user(o) }
	} else {
		cfg.Relay.Observer = a.metrics.ObserveRelay
	}
	defer func() {
		if err != nil {
			a.Close()
		}
	}()

	// Commits of outbox rows on this pool wake the relays, however the
	// service commits (see pgoutbox.CommitWatch).
	commits := pgoutbox.NewCommitWatch()
	a.pool, err = pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: cfg.DatabaseAppName, MaxConns: cfg.DatabaseMaxConns,
		Configure: commits.Watch})
	if err != nil {
		return nil, err
	}
	a.db = pgdb.SQLDB(a.pool)
	if a.cutoff, err = cutoff.New(cfg.Cutoff, a.metrics.Registry, a.logger); err != nil {
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
	table, err := cfg.Relay.Table.InSchema(cfg.DatabaseSchema)
	if err != nil {
		return nil, fmt.Errorf("FERRY_OUTBOX_TABLE: %w", err)
	}
	adapter := pgoutbox.Config{Table: table, Ordered: func(topic string) bool { return a.topology.Ordered(topic) }, MaxDelay: cfg.MaxDelay}
	if a.outbox, err = pgoutbox.New(adapter, a.logger); err != nil {
		return nil, fmt.Errorf("FERRY_OUTBOX_TABLE: %w", err)
	}
	if !cfg.Relay.PollOnly {
		// Wake-ups after the commit, from this process: see pgoutbox.Waker.
		a.waker = pgoutbox.NewWaker(a.pool, pgoutbox.WakerConfig{Logger: a.logger})
		a.outbox.SetWaker(a.waker)
		commits.OnCommit(a.waker.Committed)
	}
	handlerOutbox := a.outbox
	if cfg.Tenants {
		// A handler's follow-up events go into the outbox of its
		// event's tenant, in the transaction on the tenant's pool, whose
		// search_path is the tenant's schema: the table names none.
		tenantAdapter := adapter
		tenantAdapter.Table = cfg.Relay.Table
		if a.tenantOutbox, err = pgoutbox.New(tenantAdapter, a.logger); err != nil {
			return nil, fmt.Errorf("FERRY_OUTBOX_TABLE: %w", err)
		}
		handlerOutbox = a.tenantOutbox
	}
	if a.ledger, err = pgledger.New(a.pool, cfg.Ledger, a.logger); err != nil {
		return nil, err
	}
	if a.idempotency, err = middleware.NewIdempotency(a.ledger, a.logger); err != nil {
		return nil, err
	}
	if a.rescheduler, err = pgoutbox.NewRescheduler(a.pool, a.outbox); err != nil {
		return nil, err
	}
	if a.pauses, err = middleware.NewPauseWatch(pgpause.Source{Pool: a.pool}, 0, a.logger); err != nil {
		return nil, err
	}
	if a.poisonPublisher, err = pgpoison.NewPublisher(a.db); err != nil {
		return nil, err
	}
	if a.poison, err = pgpoison.NewStore(a.pool, a.outbox); err != nil {
		return nil, err
	}

	if a.routes, err = opts.Routes(Deps{Config: cfg, Logger: a.logger, Pool: a.pool, DB: a.db, Outbox: handlerOutbox}); err != nil {
		return nil, fmt.Errorf("building routes: %w", err)
	}
	if err := handlers.ValidateRoutes(a.routes); err != nil {
		return nil, fmt.Errorf("invalid route table: %w", err)
	}
	for _, r := range a.routes {
		a.metrics.InitRoutes(r.Name)
	}
	if opts.Tools != nil {
		ts, err := opts.Tools(Deps{Config: cfg, Logger: a.logger, Pool: a.pool, DB: a.db, Outbox: a.outbox})
		if err != nil {
			return nil, fmt.Errorf("building tools: %w", err)
		}
		if a.tools, err = agenttools.NewRunner(a.pool, a.outbox, ts, a.logger); err != nil {
			return nil, err
		}
	}

	// The ordering unit, derived once: a topic is ordered when a route on it
	// says so or FERRY_ORDERED_TOPICS names it. The topology keeps the set;
	// the relay (through its publisher) and the outbox ask it.
	amqpCfg := cfg.AMQP
	amqpCfg.OrderedTopics = slices.Clone(cfg.AMQP.OrderedTopics)
	// A tenant fleet sends a tenant's backlog on lanes of their own, so
	// that other tenants' new events do not queue behind it.
	amqpCfg.BacklogLanes = amqpCfg.BacklogLanes || cfg.Tenants
	for _, r := range a.routes {
		if r.Ordered {
			amqpCfg.OrderedTopics = append(amqpCfg.OrderedTopics, r.Topic)
		}
	}
	if a.topology, err = rabbit.NewTopology(amqpCfg); err != nil {
		return nil, fmt.Errorf("FERRY_AMQP_*: %w", err)
	}
	if err := validateBatches(a.routes, a.topology); err != nil {
		return nil, fmt.Errorf("invalid route table: %w", err)
	}
	cfg.AMQP = a.topology.Config()
	a.cfg = cfg
	if opts.WithoutBroker {
		return a, nil
	}
	if a.pubConn, err = rabbit.Dial(cfg.AMQP, "ferry-publisher", a.watermillLogger()); err != nil {
		return nil, err
	}
	if err := declareTopology(ctx, a.pubConn, a.topology, a.bindings()); err != nil {
		return nil, fmt.Errorf("declaring RabbitMQ topology: %w", err)
	}
	if a.publisher, err = wamqp.NewPublisherWithConnection(a.topology.PublisherConfig(), a.watermillLogger(), a.pubConn); err != nil {
		return nil, fmt.Errorf("creating RabbitMQ publisher: %w", err)
	}
	if a.batchPublisher, err = rabbit.NewBatchPublisher(a.pubConn, a.topology); err != nil {
		return nil, err
	}
	relayCfg := cfg.Relay
	relayCfg.OrderedTopics = a.topology.OrderedTopics()
	if a.relay, err = pgoutbox.NewRelay(a.pool, a.batchPublisher, relayCfg, a.logger); err != nil {
		return nil, err
	}
	if a.waker != nil {
		a.waker.OnCommit(a.relay.Wake) // a relay of this process wakes without a round trip
	}
	if cfg.Tenants {
		fleetCfg := cfg.Fleet
		fleetCfg.Relay = relayCfg
		fleetCfg.ControlSchema = cfg.DatabaseSchema
		fleetCfg.Pools.ControlURL = cfg.DatabaseURL
		fleetCfg.Pools.ApplicationName = cfg.DatabaseAppName + "-tenants"
		// A tenant's backlog goes when the route table's queues have
		// room, so that a quiet tenant's event does not wait behind it at
		// the broker (tenancy.Config.Room).
		fleetCfg.Room = func(ctx context.Context) (bool, error) {
			stats, err := a.QueueStats(ctx)
			if err != nil {
				return false, err
			}
			// The queues backlogs are sent to: the backlog lanes, and the
			// partitions of ordered topics (which have no lanes). The
			// other queues take only new events, which never wait for room.
			ready := 0
			for _, s := range stats {
				if strings.Contains(s.Handler, pipeline.PartitionSeparator) {
					ready += s.Ready
				}
			}
			return ready < fleetCfg.BacklogRoom, nil
		}
		fleetCfg.Observer = a.metrics.ObserveTenant
		if a.fleet, err = tenancy.New(a.pool, a.batchPublisher, fleetCfg, a.logger); err != nil {
			return nil, fmt.Errorf("FERRY_TENANTS_*: %w", err)
		}
		a.metrics.Tenants = func() metrics.TenantReadings {
			r := metrics.TenantReadings{Failing: map[string]bool{}}
			for _, t := range a.fleet.Served() {
				r.Failing[t.Tenant.ID] = t.Failing
			}
			_, r.PoolConnections, r.ListenConnections = a.fleet.Connections()
			return r
		}
		if a.ledgers, err = tenancy.NewLedgers(a.fleet, a.tenantOutbox, a.rescheduler, cfg.Ledger, a.logger); err != nil {
			return nil, err
		}
		if a.idempotency, err = middleware.NewIdempotency(a.ledgers, a.logger); err != nil {
			return nil, err
		}
		if a.parking, err = tenancy.NewParking(a.fleet, pgparked.Store{Pool: a.pool}, a.batchPublisher, a.logger); err != nil {
			return nil, err
		}
	}
	if cfg.RelayMode == RelayModeCDC {
		if a.cdc, err = pgcdc.NewStreamer(a.pool, a.relay, cfg.Relay.Table, cfg.CDC, a.logger); err != nil {
			return nil, fmt.Errorf("FERRY_CDC_*: %w", err)
		}
		a.cdc.Wake = a.relay.Wake
		a.metrics.CDC = a.cdc.Stats
	}
	a.metrics.Unrouted = a.UnroutedDepth
	a.metrics.Queues = a.QueueStats
	return a, nil
}

func (a *App) checkSchema(ctx context.Context) error {
	if a.cfg.RelayMode == RelayModeCDC && a.opts.Migrate {
		// Refuse before changing anything: a CDC relay on a server that
		// cannot stream would otherwise leave a migrated schema behind.
		if err := pgcdc.CheckServer(ctx, a.pool); err != nil {
			return fmt.Errorf("FERRY_RELAY_MODE=cdc: %w", err)
		}
	}
	if a.cfg.DatabaseSchema != "" && a.opts.Migrate {
		if err := pgdb.EnsureSchema(ctx, a.pool, a.cfg.DatabaseSchema); err != nil {
			return err
		}
	}
	sets, err := MigrationSets(a.opts)
	if err != nil {
		return err
	}
	for _, set := range sets {
		var pending bool
		err := waitOutOutage(ctx, func() (err error) {
			pending, err = set.Pending(ctx, a.db)
			return err
		})
		if err != nil {
			return err
		}
		if !pending {
			continue
		}
		if !a.opts.Migrate {
			return fmt.Errorf("%w (set %s)", ErrMigrationsPending, set.Name)
		}
		n, err := set.Up(ctx, a.db)
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

// declareTopology declares the route table's topology. A quorum queue the
// broker cannot place for the moment (INTERNAL_ERROR, "cluster_not_formed":
// its Raft system starting or busy) is a broker blip, not a bad
// configuration: the broker closes the connection, and the declaration is
// tried again on the reconnected one, for up to 30 s.
func declareTopology(ctx context.Context, conn *wamqp.ConnectionWrapper, topo *rabbit.Topology, bindings []rabbit.Binding) error {
	deadline := time.Now().Add(30 * time.Second)
	for attempt := 1; ; attempt++ {
		err := topo.Declare(conn.Connection(), bindings...)
		var aerr *amqp.Error
		if err == nil || !errors.As(err, &aerr) || aerr.Code != amqp.InternalError || time.Now().After(deadline) {
			return err
		}
		if err := pipeline.Sleep(ctx, time.Duration(attempt)*500*time.Millisecond); err != nil {
			return err
		}
		select {
		case <-conn.Connected():
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Second):
		}
	}
}

// waitOutOutage runs fn until it succeeds or fails with something other
// than the database dropping connections (pgdb.Unavailable: a failover,
// backends terminated, a restart), backing off up to 5 s, for at most
// StartPatience: a process starting during an outage waits it out instead
// of exiting (a consumer restarted during a failover exited on its
// heartbeat's registration, and its queues were left without a consumer).
func waitOutOutage(ctx context.Context, fn func() error) error {
	wait := 100 * time.Millisecond
	deadline := time.Now().Add(StartPatience)
	for {
		err := fn()
		if err == nil || !pgdb.Unavailable(err) || time.Now().Add(wait).After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// StartPatience bounds how long a starting process waits out a database
// that drops its connections before its start fails.
const StartPatience = 2 * time.Minute
