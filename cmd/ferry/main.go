// Command ferry runs Ferry's transactional-outbox pipeline: the relay, the
// consumers and the create_order HTTP API, its migrations and its demo.
// Configuration comes from FERRY_* environment variables; `ferry help`
// lists the commands and `ferry help config` the variables.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgconn"
)

const usage = `ferry: a transactional-outbox event pipeline (PostgreSQL → RabbitMQ → idempotent consumers)

Usage:
  ferry <command> [flags]

Commands:
  demo                 run the whole pipeline once against local PostgreSQL and RabbitMQ
                       (fresh schema ferry_demo, in-process payment provider and SMTP sink)
                       and print what happened; exits non-zero if an effect was lost or doubled
  run [--migrate]      run the relay, the consumers, the HTTP API and the hourly pruning in one process
  relay [--migrate]    run only the outbox relay (run several for throughput and failover)
  consume [--migrate]  run only the consumer router (every handler of the route table)
  bench [flags]        benchmark the pipeline against local PostgreSQL and RabbitMQ: one JSON
                       object per scenario on stdout, a table on stderr (ferry bench -h)
  chaos [--long] [--orders N] [--rate R] [--seed S] [--json]
                       fault-injection run: orders at a steady rate while relay and consumer
                       processes are SIGKILLed, database backends terminated, broker connections
                       cut and handlers fail/panic; exits non-zero if anything was lost or doubled
  status [--attempts N] [--json]
                       pending per topic, oldest pending, rows failing with their last error,
                       poison store depth, relay/consumer liveness
  poison list [--topic T] [--limit N] [--json]
                       what is in the poison store, why, since when
  poison requeue (--id ID,... | --topic T | --all) [--limit N] [--dry-run] [--json]
                       send poisoned messages back to their original topic (attempts reset),
                       atomically: an interrupted requeue loses and doubles nothing
  poison discard (--id ID,... | --topic T | --all) [--limit N] [--dry-run] [--json]
                       delete poisoned messages
  prune outbox [--older-than 720h] [--archive] [--batch-size N] [--dry-run] [--json]
                       remove (or archive) dispatched outbox rows past their retention
  prune ledger [--older-than 336h] [--batch-size N] [--dry-run] [--json]
                       remove consumer ledger rows past their retention
  migrate up           apply pending database migrations
  migrate down         roll back the newest migration
  migrate status       list migrations and whether each is applied
  healthcheck [--url URL]
                       exit 0 if URL (default: the admin server's /readyz) answers 200; for
                       container healthchecks, the image having no shell or curl
  help [config]        show this help, or the configuration variables
  version              print the version

Flags:
  --migrate            apply pending migrations at start instead of refusing to start

Configuration is read from FERRY_* environment variables: see "ferry help config".
`

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	cmd, rest := args[0], args[1:]
	var err error
	switch cmd {
	case "help", "-h", "--help":
		if len(rest) > 0 && rest[0] == "config" {
			printConfigHelp(stdout)
		} else {
			fmt.Fprint(stdout, usage)
		}
		return 0
	case "version", "--version":
		fmt.Fprintln(stdout, "ferry", version)
		return 0
	case "demo":
		err = demo(ctx, rest, stdout)
	case "run":
		err = serve(ctx, cmd, rest, app.All)
	case "relay":
		err = serve(ctx, cmd, rest, app.Components{Relay: true})
	case "consume":
		err = serve(ctx, cmd, rest, app.Components{Consumers: true})
	case "migrate":
		err = migrate(ctx, rest, stdout)
	case "bench":
		err = bench(ctx, rest, stdout, stderr)
	case "poison":
		err = poison(ctx, rest, stdout)
	case "status":
		err = status(ctx, rest, stdout)
	case "chaos":
		err = chaos(ctx, rest, stdout, stderr)
	case "healthcheck":
		err = healthcheck(ctx, rest, stdout)
	case "prune":
		err = prune(ctx, rest, stdout)
	default:
		fmt.Fprintf(stderr, "ferry: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	var usageErr usageError
	switch {
	case errors.As(err, &usageErr):
		fmt.Fprintf(stderr, "ferry %s: %s\n", cmd, oneLine(err))
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "ferry %s: %s%s\n", cmd, oneLine(err), hint(err))
		return 1
	}
	return 0
}

type usageError struct{ error }

// oneLine folds a (joined, multi-line) error into one line, for logs and
// terminals alike.
func oneLine(err error) string {
	fields := strings.FieldsFunc(err.Error(), func(r rune) bool { return r == '\n' || r == '\r' || r == '\t' })
	return strings.Join(fields, "; ")
}

// hint says what to do about the errors an operator meets first.
func hint(err error) string {
	msg := err.Error()
	switch {
	case strings.Contains(msg, "PostgreSQL") && (strings.Contains(msg, "password authentication failed") || strings.Contains(msg, "does not exist")):
		return " (check the user, password and database in FERRY_DATABASE_URL)"
	case strings.Contains(msg, "cannot reach PostgreSQL"):
		return " (is PostgreSQL running? check FERRY_DATABASE_URL)"
	case strings.Contains(msg, "RabbitMQ") && (strings.Contains(msg, "403") || strings.Contains(msg, "not allowed")):
		return " (check the user, password and vhost in FERRY_AMQP_URL)"
	case strings.Contains(msg, "connecting to RabbitMQ"):
		return " (is RabbitMQ running? check FERRY_AMQP_URL)"
	}
	return ""
}

func parseFlags(cmd string, args []string, migrate *bool) error {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if migrate != nil {
		fs.BoolVar(migrate, "migrate", false, "apply pending migrations at start")
	}
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	return nil
}

func loadConfig() (app.Config, error) {
	cfg, err := app.ConfigFromEnv()
	if err != nil {
		return cfg, fmt.Errorf("invalid configuration: %w", err)
	}
	return cfg, nil
}

func demo(ctx context.Context, args []string, stdout io.Writer) error {
	if err := parseFlags("demo", args, nil); err != nil {
		return err
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	logger, err := app.NewLogger(app.Config{LogLevel: "warn", LogFormat: cfg.LogFormat}, nil)
	if err != nil {
		return err
	}
	if os.Getenv("FERRY_LOG_LEVEL") != "" {
		logger, _ = app.NewLogger(cfg, nil)
	}
	_, err = app.Demo(ctx, cfg, stdout, logger)
	return err
}

func serve(ctx context.Context, cmd string, args []string, what app.Components) error {
	var migrate bool
	if err := parseFlags(cmd, args, &migrate); err != nil {
		return err
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	logger, err := app.NewLogger(cfg, nil)
	if err != nil {
		return err
	}
	a, err := app.New(ctx, cfg, app.Options{Migrate: migrate, Logger: logger, Version: version})
	if err != nil {
		return err
	}
	defer a.Close()
	logger.Info("ferry started", "command", cmd, "version", version)
	return a.Run(ctx, what, nil)
}

func migrate(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) != 1 {
		return usageError{errors.New("want one of: up, down, status")}
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	pool, err := pgconn.Open(ctx, pgconn.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-migrate"})
	if err != nil {
		return err
	}
	defer pool.Close()
	db := pgconn.SQLDB(pool)
	defer db.Close()
	switch args[0] {
	case "up":
		if cfg.DatabaseSchema != "" {
			if err := pgconn.CreateSchema(ctx, pool, cfg.DatabaseSchema); err != nil {
				return err
			}
		}
		n, err := migrations.Up(ctx, db)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "applied %d migration(s)\n", n)
	case "down":
		if err := migrations.Down(ctx, db); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "rolled back 1 migration")
	case "status":
		states, err := migrations.Status(ctx, db)
		if err != nil {
			return err
		}
		for _, s := range states {
			mark := "pending"
			if s.Applied {
				mark = "applied"
			}
			fmt.Fprintf(stdout, "%05d  %-8s %s\n", s.Version, mark, s.Name)
		}
	default:
		return usageError{fmt.Errorf("unknown migrate command %q: want up, down or status", args[0])}
	}
	return nil
}

func bench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var (
		bc                         app.BenchConfig
		scenarios, relays, history string
	)
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&scenarios, "scenario", strings.Join(app.BenchScenarios, ","), "comma-separated scenarios to run")
	fs.IntVar(&bc.Events, "events", 50_000, "relay_throughput: events preloaded per run")
	fs.IntVar(&bc.BaselineEvents, "baseline-events", 5_000, "relay_throughput: events pushed through Watermill's stock forwarder")
	fs.StringVar(&relays, "relays", "1,2,4", "relay_throughput: relay counts to run")
	fs.IntVar(&bc.BatchSize, "batch-size", 100, "relay and raw-loop batch size")
	fs.IntVar(&bc.Rate, "rate", 1000, "end_to_end_latency: producer events/s")
	fs.DurationVar(&bc.Duration, "duration", 10*time.Second, "end_to_end_latency: length of the steady load")
	fs.IntVar(&bc.Orders, "orders", 2000, "write_overhead: create_order transactions per variant")
	fs.StringVar(&history, "history", "10000,1000000", "claim_cost_vs_history: dispatched-row counts (add 10000000 for 10M)")
	fs.IntVar(&bc.ClaimRounds, "claim-rounds", 200, "claim_cost_vs_history: claims timed per history size")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usageError{err}
	}
	var err error
	bc.Scenarios = splitList(scenarios)
	if bc.Relays, err = intList(relays); err != nil {
		return usageError{fmt.Errorf("--relays: %w", err)}
	}
	if bc.History, err = intList(history); err != nil {
		return usageError{fmt.Errorf("--history: %w", err)}
	}
	cfg, logger, err := quietConfig(stderr)
	if err != nil {
		return err
	}
	return app.Bench(ctx, cfg, bc, stdout, stderr, logger)
}

// quietConfig loads the configuration and a logger that prints only
// errors, for commands whose own output is the point (bench, chaos).
func quietConfig(stderr io.Writer) (app.Config, *slog.Logger, error) {
	cfg, err := loadConfig()
	if err != nil {
		return cfg, nil, err
	}
	logger, err := app.NewLogger(app.Config{LogLevel: "error", LogFormat: cfg.LogFormat}, stderr)
	return cfg, logger, err
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func intList(s string) ([]int, error) {
	var out []int
	for _, p := range splitList(s) {
		n, err := strconv.Atoi(p)
		if err != nil {
			return nil, fmt.Errorf("%q is not a whole number", p)
		}
		out = append(out, n)
	}
	return out, nil
}

func printConfigHelp(w io.Writer) {
	fmt.Fprintln(w, "Configuration (environment variables; defaults in brackets):")
	for _, ev := range app.EnvVars() {
		fmt.Fprintf(w, "  %-30s %s [%s]\n", ev.Name, ev.Doc, ev.Default)
	}
}
