package app

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/handlers/charge"
	"github.com/ferry-dev/ferry/handlers/mail"
	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/orders"
	"github.com/ferry-dev/ferry/pipeline/pgconn"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/tracing"
)

// ErrMigrationsPending is returned by New when the schema is behind the
// binary and Options.Migrate is off: run `ferry migrate up` first.
var ErrMigrationsPending = errors.New("database migrations are pending: run `ferry migrate up` (or start with --migrate)")

// Deps is what a route table may use to build its handlers.
type Deps struct {
	Config Config
	Logger *slog.Logger
}

// Options are the application's extension points.
type Options struct {
	// Routes builds the route table: every consumer handler. Default
	// ExampleRoutes (the orders example's charge and mail handlers).
	Routes func(Deps) ([]handlers.Route, error)
	// Chain edits the router-wide middleware chain, for instance
	// c.InsertAfter(middleware.LinkCorrelation, myLoggingLink) or c.Append(...).
	Chain func(middleware.Chain) (middleware.Chain, error)
	// Migrate applies pending migrations at start instead of refusing to start.
	Migrate bool
	// Logger receives every log line. Default: NewLogger(cfg, os.Stderr).
	Logger *slog.Logger
	// TracerProvider receives Ferry's spans. Default: the global one.
	TracerProvider trace.TracerProvider
	// Version is reported in ferry status. Default "dev".
	Version string
	// WithoutBroker builds an app that only writes events (a web service
	// placing orders): no broker connection, so no relay and no consumers.
	// The relays declare the topology when they start.
	WithoutBroker bool
}

// ExampleRoutes is the route table of the orders example: the application's
// contents page. An application of your own returns its own list here.
func ExampleRoutes(d Deps) ([]handlers.Route, error) {
	payments, err := charge.NewHTTPClient(d.Config.PaymentURL)
	if err != nil {
		return nil, fmt.Errorf("FERRY_PAYMENT_URL: %w", err)
	}
	smtp, err := mail.NewSMTPSender(d.Config.SMTPAddr)
	if err != nil {
		return nil, fmt.Errorf("FERRY_SMTP_ADDR: %w", err)
	}
	return []handlers.Route{
		charge.Route(payments, d.Logger),          // stripe.charge → payment provider (ordered per order)
		mail.Route(smtp, d.Config.Mail, d.Logger), // mail.send → SMTP
	}, nil
}

// App is a wired Ferry application.
type App struct {
	cfg    Config
	opts   Options
	logger *slog.Logger

	Pool        *pgxpool.Pool
	DB          *sql.DB
	Outbox      *pgoutbox.Outbox
	Orders      *orders.Service
	Topology    *rabbit.Topology
	Relay       *pgoutbox.Relay
	Ledger      *pgledger.Ledger
	Idempotency *middleware.Idempotency
	Rescheduler *pgoutbox.Rescheduler
	Poison      *pgpoison.Store
	Metrics     *metrics.Metrics
	Routes      []handlers.Route
	tracer      *tracing.Tracer

	pubConn         *wamqp.ConnectionWrapper
	publisher       *wamqp.Publisher
	batchPublisher  *rabbit.BatchPublisher
	poisonPublisher message.Publisher
}

// OrderedTopics is the sorted set of topics consumed in per-aggregate order:
// those of routes marked Ordered plus Config.OrderedTopics.
func (a *App) OrderedTopics() []string {
	set := map[string]bool{}
	for _, t := range a.cfg.OrderedTopics {
		set[t] = true
	}
	for _, r := range a.Routes {
		if r.Ordered {
			set[r.Topic] = true
		}
	}
	out := make([]string, 0, len(set))
	for t := range set {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// New connects to PostgreSQL and RabbitMQ, checks the schema, declares the
// broker topology of the route table and wires every component. It fails
// fast, with the address, when a server is unreachable.
func New(ctx context.Context, cfg Config, opts Options) (_ *App, err error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration: %w", err)
	}
	if opts.Logger == nil {
		opts.Logger, err = NewLogger(cfg, nil)
		if err != nil {
			return nil, err
		}
	}
	if opts.Routes == nil {
		opts.Routes = ExampleRoutes
	}
	if cfg.ChaosFaults != nil {
		opts = chaosOptions(opts, *cfg.ChaosFaults)
	}
	a := &App{cfg: cfg, opts: opts, logger: opts.Logger, Metrics: metrics.New(), tracer: tracing.New(opts.TracerProvider)}
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
	if err := a.checkSchema(ctx); err != nil {
		return nil, err
	}

	a.Outbox = pgoutbox.New(pgoutbox.SchemaAdapter{}, a.logger)
	if a.Orders, err = orders.NewService(a.DB, a.Outbox, a.logger); err != nil {
		return nil, err
	}
	if a.Ledger, err = pgledger.New(a.Pool, pgledger.Config{}, a.logger); err != nil {
		return nil, err
	}
	if a.Idempotency, err = middleware.NewIdempotency(a.Ledger, a.logger); err != nil {
		return nil, err
	}
	if a.Rescheduler, err = pgoutbox.NewRescheduler(a.Pool, ""); err != nil {
		return nil, err
	}
	if a.poisonPublisher, err = pgpoison.NewPublisher(a.DB); err != nil {
		return nil, err
	}
	if a.Poison, err = pgpoison.NewStore(a.Pool, ""); err != nil {
		return nil, err
	}

	if a.Routes, err = opts.Routes(Deps{Config: cfg, Logger: a.logger}); err != nil {
		return nil, fmt.Errorf("building routes: %w", err)
	}
	if err := handlers.ValidateRoutes(a.Routes); err != nil {
		return nil, fmt.Errorf("invalid route table: %w", err)
	}

	// The ordering unit, visible in one place: a topic is ordered when a
	// route on it says so or FERRY_ORDERED_TOPICS names it; the relay and
	// the broker topology then agree on it.
	ordered := a.OrderedTopics()
	cfg.AMQP.OrderedTopics, cfg.Relay.OrderedTopics = ordered, ordered
	a.cfg = cfg
	if a.Topology, err = rabbit.NewTopology(cfg.AMQP); err != nil {
		return nil, fmt.Errorf("FERRY_AMQP_*: %w", err)
	}
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
	if a.Relay, err = pgoutbox.NewRelay(a.Pool, a.batchPublisher, cfg.Relay, a.logger); err != nil {
		return nil, err
	}
	return a, nil
}

func (a *App) checkSchema(ctx context.Context) error {
	if a.cfg.DatabaseSchema != "" && a.opts.Migrate {
		if err := pgconn.CreateSchema(ctx, a.Pool, a.cfg.DatabaseSchema); err != nil {
			return err
		}
	}
	pending, err := migrations.Pending(ctx, a.DB)
	if err != nil {
		return err
	}
	if !pending {
		return nil
	}
	if !a.opts.Migrate {
		return ErrMigrationsPending
	}
	n, err := migrations.Up(ctx, a.DB)
	if err != nil {
		return err
	}
	a.logger.Info("applied database migrations", "count", n, "schema", a.cfg.DatabaseSchema)
	return nil
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
	out, err := pgretention.Prune(ctx, a.Pool, pgretention.Outbox, pgretention.Options{OlderThan: r.Outbox, BatchSize: r.BatchSize, Archive: r.ArchiveOutbox})
	if err != nil {
		return nil, err
	}
	led, err := pgretention.Prune(ctx, a.Pool, pgretention.Ledger, pgretention.Options{OlderThan: r.Ledger, BatchSize: r.BatchSize})
	if err != nil {
		return []pgretention.Result{out}, err
	}
	return []pgretention.Result{out, led}, nil
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

// NewRouter builds the consumer router: the middleware chain (edited by
// Options.Chain) around every route of the table, each consuming its own
// queue over one shared connection.
func (a *App) NewRouter() (*message.Router, *wamqp.ConnectionWrapper, error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: a.cfg.ShutdownTimeout}, a.watermillLogger())
	if err != nil {
		return nil, nil, err
	}
	durable := a.cfg.DurableRetry
	durable.Scheduler = a.Rescheduler
	chain, err := middleware.DefaultChain(middleware.ChainConfig{
		Poison:       middleware.PoisonConfig{Publisher: a.poisonPublisher},
		DurableRetry: durable,
		Retry:        a.cfg.Retry,
		Idempotency:  a.Idempotency,
		Logger:       a.logger,
		Recorder:     a.Metrics,
		Tracing:      a.tracer.Consumer,
	})
	if err != nil {
		return nil, nil, err
	}
	if a.opts.Chain != nil {
		if chain, err = a.opts.Chain(chain); err != nil {
			return nil, nil, fmt.Errorf("editing middleware chain: %w", err)
		}
	}
	// Watermill's own router metrics (handler execution time, publish and
	// subscribe counts) go to the same registry; added first, so outermost.
	wmetrics.NewPrometheusMetricsBuilder(a.Metrics.Registry, "", "").AddPrometheusRouterMetrics(router)
	router.AddMiddleware(chain.Middlewares()...)
	// One connection for every consumer of the process; the router's
	// subscribers share it and Run closes it when the router has stopped.
	conn, err := rabbit.Dial(a.cfg.AMQP, "ferry-consumer", a.watermillLogger())
	if err != nil {
		return nil, nil, err
	}
	for _, r := range a.Routes {
		// An ordered route consumes one queue per partition, each its own
		// router handler ("<route>@<k>"), so order holds per partition.
		for _, s := range a.Topology.Subscriptions(r.Name, r.Topic) {
			sub, err := wamqp.NewSubscriberWithConnection(s.Config, a.watermillLogger(), conn)
			if err != nil {
				conn.Close()
				return nil, nil, fmt.Errorf("subscribing %s to %s: %w", s.Name, r.Topic, err)
			}
			h := router.AddConsumerHandler(s.Name, r.Topic, sub, r.Handler)
			h.AddMiddleware(r.Middleware...)
		}
	}
	return router, conn, nil
}

// Run runs the selected components until ctx is done or one fails.
// ready, if not nil, is closed once the consumers (if any) are consuming and
// the HTTP API (if any) is listening.
func (a *App) Run(ctx context.Context, what Components, ready chan<- struct{}) error {
	if a.opts.WithoutBroker && (what.Relay || what.Consumers) {
		return errors.New("an app built WithoutBroker runs neither relay nor consumers")
	}
	g, ctx := errgroup.WithContext(ctx)
	var waits []<-chan struct{}

	if what.Relay {
		g.Go(func() error { return a.Relay.Run(ctx) })
	}
	if what.Pruner {
		g.Go(func() error { return a.runPruner(ctx) })
	}
	if what.Relay || what.Consumers {
		hb, err := pgstatus.NewHeartbeat(ctx, a.Pool, watermill.NewShortUUID(), what.names(), a.version())
		if err != nil {
			return err
		}
		g.Go(func() error { hb.Run(ctx, pgstatus.DefaultHeartbeatInterval); return nil })
	}
	g.Go(func() error { a.Metrics.RunRefresher(ctx, a.Pool, a.cfg.MetricsRefresh, a.logger); return nil })
	if a.cfg.AdminAddr != "off" {
		if err := a.serve(ctx, g, "admin", a.cfg.AdminAddr, a.AdminHandler()); err != nil {
			return err
		}
	}
	if what.Consumers {
		router, conn, err := a.NewRouter()
		if err != nil {
			return err
		}
		waits = append(waits, router.Running())
		g.Go(func() error {
			defer conn.Close()
			if err := router.Run(ctx); err != nil {
				return fmt.Errorf("consumer router: %w", err)
			}
			return nil
		})
	}
	if what.HTTP {
		if err := a.serve(ctx, g, "HTTP API", a.cfg.HTTPAddr, a.HTTPHandler()); err != nil {
			return err
		}
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

// serve runs an HTTP server on addr in g until ctx ends, then shuts it down gracefully.
func (a *App) serve(ctx context.Context, g *errgroup.Group, name, addr string, h http.Handler) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("%s: listening on %s: %w", name, addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	a.logger.Info(name+" listening", "addr", ln.Addr().String())
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s: %w", name, err)
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.cfg.ShutdownTimeout)
		defer cancel()
		return srv.Shutdown(sctx)
	})
	return nil
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

// HTTPHandler is the HTTP API: POST /orders and GET /healthz.
func (a *App) HTTPHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /orders", a.tracer.HTTP("POST /orders", orders.Handler(a.Orders, a.logger)))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

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
	return errors.Join(errs...)
}

// Config returns the configuration the app runs with (defaults applied).
func (a *App) Config() Config { return a.cfg }
