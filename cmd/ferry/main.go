// Command ferry runs Ferry's transactional-outbox pipeline with the orders
// example (examples/orders): the relay, the consumers, the create_order HTTP
// API, the operations commands (package cli), and the rigs that live beside
// the CLI rather than in the library: demo, sandbox, bench and chaos.
// Configuration comes from FERRY_* environment variables; `ferry help`
// lists the commands and `ferry help config` the variables.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/bench"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/chaos"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/demo"
	"github.com/ferry-dev/ferry/examples/orders/ordersapp"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return cli.New(options()).Run(ctx, args, stdout, stderr)
}

func options() cli.Options {
	return cli.Options{
		Name:     "ferry",
		Version:  version,
		App:      exampleApp,
		EnvVars:  envVars(),
		Commands: []*cli.Command{cmdDemo, cmdSandbox, cmdBench, cmdChaos},
	}
}

// envVars are the binary's own variables: the orders example's, and the
// rigs' (set by ferry chaos and ferry bench on their children).
func envVars() []app.EnvVar {
	return append(ordersapp.EnvVars(),
		app.EnvVar{Name: "FERRY_CHAOS_EVENT_VERSION", Default: "(none)", Doc: "testing only: run version 1, 2 or 3 of the charge event's code, as the chaos run's version roll does (ferry chaos --versions sets it)"},
		app.EnvVar{Name: "FERRY_CHAOS_FAULTS", Default: "(none)", Doc: "testing only: inject handler faults, e.g. fail=0.1,panic=0.01,seed=7 (ferry chaos sets it)"},
		app.EnvVar{Name: "FERRY_BENCH_CHILD", Default: "(none)", Doc: "benchmark only: ferry bench runs as a relay or consume child of its memory scenario (the parent sets it)"},
		app.EnvVar{Name: "FERRY_BENCH_CHILD_CPUPROFILE", Default: "(none)", Doc: "benchmark only: where a child of the memory scenario writes its CPU profile, its kind and pid appended (the parent sets it from --cpuprofile)"})
}

// exampleApp is the orders example on Ferry's runtime; under `ferry chaos`
// (FERRY_CHAOS_FAULTS) its handlers also suffer injected faults.
func exampleApp() (app.Options, error) {
	ex, err := ordersapp.ConfigFromEnv()
	if err != nil {
		return app.Options{}, fmt.Errorf("invalid configuration: %w", err)
	}
	opts := ordersapp.Options(ex)
	if v := os.Getenv("FERRY_CHAOS_EVENT_VERSION"); v != "" {
		n, err := chaos.ParseEventVersion(v)
		if err != nil {
			return opts, fmt.Errorf("invalid configuration: FERRY_CHAOS_EVENT_VERSION=%q: %w", v, err)
		}
		opts = chaos.WithEventVersion(opts, n, ex.PaymentURL)
	}
	if v := os.Getenv("FERRY_CHAOS_FAULTS"); v != "" {
		f, err := chaos.ParseFaults(v)
		if err != nil {
			return opts, fmt.Errorf("invalid configuration: FERRY_CHAOS_FAULTS=%q: %w", v, err)
		}
		opts = chaos.WithFaults(opts, *f, ex.PaymentURL)
	}
	return opts, nil
}

var cmdDemo = &cli.Command{
	Name:    "demo",
	Summary: "run the whole pipeline once against local PostgreSQL and RabbitMQ (fresh schema ferry_demo, in-process payment provider and SMTP sink) and print what happened; exits non-zero if an effect was lost or doubled",
	Flags: func(_ *flag.FlagSet, env *cli.Env) cli.RunFunc {
		return func(ctx context.Context, _ []string) error {
			cfg, err := cli.LoadConfig()
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
			_, err = demo.Demo(ctx, cfg, env.Stdout, logger)
			return err
		}
	},
}

var cmdSandbox = &cli.Command{
	Name:    "sandbox",
	Summary: "run the orders example's fake payment provider and SMTP sink (addresses printed) until interrupted, so `ferry run` has something to talk to",
	Long: `The payment provider answers POST /v1/charges (idempotent by Idempotency-Key) and records
every charge; the SMTP sink accepts every mail. Both print what arrives. Point the
example at them with FERRY_PAYMENT_URL and FERRY_SMTP_ADDR (their defaults match).`,
	Flags: func(fs *flag.FlagSet, env *cli.Env) cli.RunFunc {
		payments := fs.String("payments-addr", "", "payment provider listen address (default: the host:port of FERRY_PAYMENT_URL)")
		smtp := fs.String("smtp-addr", "", "SMTP sink listen address (default FERRY_SMTP_ADDR)")
		return func(ctx context.Context, _ []string) error {
			ex, err := ordersapp.ConfigFromEnv()
			if err != nil {
				return fmt.Errorf("invalid configuration: %w", err)
			}
			if *payments == "" {
				u, err := url.Parse(ex.PaymentURL)
				if err != nil {
					return fmt.Errorf("FERRY_PAYMENT_URL: %w", err)
				}
				*payments = u.Host
			}
			if *smtp == "" {
				*smtp = ex.SMTPAddr
			}
			p, err := sandbox.StartPaymentProvider(*payments)
			if err != nil {
				return err
			}
			defer p.Close()
			s, err := sandbox.StartSMTPSink(*smtp)
			if err != nil {
				return err
			}
			defer s.Close()
			fmt.Fprintf(env.Stdout, "payment provider  %s  (FERRY_PAYMENT_URL)\nSMTP sink         %s  (FERRY_SMTP_ADDR)\nwaiting; Ctrl-C stops\n", p.URL(), s.Addr())
			return reportSandbox(ctx, env.Stdout, p, s)
		}
	},
}

// reportSandbox prints each new charge and mail until ctx ends.
func reportSandbox(ctx context.Context, w io.Writer, p *sandbox.PaymentProvider, s *sandbox.SMTPSink) error {
	var charges, mails int
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	report := func() {
		for _, c := range p.Charges()[charges:] {
			fmt.Fprintf(w, "charge  %+v\n", c)
			charges++
		}
		for _, m := range s.Mails()[mails:] {
			fmt.Fprintf(w, "mail    from %s to %v\n", m.From, m.To)
			mails++
		}
	}
	for {
		select {
		case <-ctx.Done():
			report() // what arrived since the last tick: a stop loses none of it
			fmt.Fprintf(w, "stopped: %d charge(s), %d mail(s)\n", charges, mails)
			return nil
		case <-t.C:
		}
		report()
	}
}

var cmdBench = &cli.Command{
	Name:    "bench",
	Summary: "benchmark the pipeline against local PostgreSQL and RabbitMQ: one JSON object per scenario on stdout, a table on stderr",
	Flags: func(fs *flag.FlagSet, env *cli.Env) cli.RunFunc {
		var bc bench.BenchConfig
		scenarios := fs.String("scenario", strings.Join(bench.BenchScenarios, ","), "comma-separated scenarios to run")
		fs.IntVar(&bc.Events, "events", 50_000, "relay_throughput: events preloaded per run")
		fs.IntVar(&bc.BaselineEvents, "baseline-events", 5_000, "relay_throughput: events pushed through Watermill's stock forwarder")
		relays := fs.String("relays", "1,2,4", "relay_throughput: relay counts to run")
		fs.IntVar(&bc.BatchSize, "batch-size", 100, "relay and raw-loop batch size (relay_throughput: the relay's catch-up pages too, to compare with the raw loops)")
		fs.IntVar(&bc.InFlight, "in-flight", 0, "relay_throughput: batches each relay has in flight (0: the relay's default, 1)")
		relayModes := fs.String("relay-mode", "notify", "relay_throughput, end_to_end_latency and held_xmin: relay modes to run; cdc adds the CDC relay's rows next to the notify relay's (which always run), in the same run")
		fs.IntVar(&bc.Rate, "rate", 1000, "end_to_end_latency and held_xmin_steady: producer events/s")
		fs.DurationVar(&bc.Duration, "duration", 10*time.Second, "end_to_end_latency and held_xmin_steady: length of the steady load")
		fs.IntVar(&bc.Orders, "orders", 2000, "write_overhead: create_order transactions per variant")
		writers := fs.String("writers", "4,32", "producer_concurrency: concurrent writer counts")
		fs.IntVar(&bc.Rounds, "rounds", 2, "producer_concurrency: runs of each variant (rotated)")
		fs.DurationVar(&bc.ProducerDuration, "producer-duration", 4*time.Second, "producer_concurrency: length of one run")
		fs.IntVar(&bc.ConsumerEvents, "consumer-events", 20_000, "consumer_throughput: messages the consumer process drains")
		fs.IntVar(&bc.DiscardRows, "discard-rows", bench.PoisonDiscardRows, "poison_discard: poisoned messages previewed and discarded as the console does it")
		fs.IntVar(&bc.SearchRows, "search-rows", 10_000_000, "search_load: dispatched rows in the outbox the operators' searches read (the consumer drains --consumer-events messages alone, then as many while they search)")
		fs.IntVar(&bc.Tenants, "tenants", 100, "tenants: tenants (schemas) one fleet process serves: one with a backlog, the others at 1 event/s each")
		fs.IntVar(&bc.TenantBacklog, "tenant-backlog", 1_000_000, "tenants: the noisy tenant's backlog")
		fs.IntVar(&bc.HeldXminEvents, "held-xmin-events", 50_000, "held_xmin: events inserted and drained per round")
		fs.IntVar(&bc.HeldXminRounds, "held-xmin-rounds", 6, "held_xmin: rounds without, then with, a long transaction holding the horizon")
		fs.BoolVar(&bc.HeldXminRelayOnly, "held-xmin-relay-only", false, "held_xmin_steady: run the relay without the app's consumer (an auto-ack drain empties the queue), to measure dispatch on a machine too small for the whole app at --rate")
		fs.Func("server-setting", "held_xmin and held_xmin_steady: a PostgreSQL setting (name=value) for the server the scenario starts of its own, after the scenario's (repeat the flag for more), e.g. log_autovacuum_min_duration=0", func(v string) error {
			bc.ServerSettings = append(bc.ServerSettings, v)
			return nil
		})
		fs.StringVar(&bc.ServerLog, "server-log", "", "held_xmin and held_xmin_steady: append the log of the server the scenario starts to this file when it ends (the server's files are removed)")
		fs.IntVar(&bc.DrainEvents, "drain-events", 20_000, "end_to_end_drain: business transactions committed")
		fs.IntVar(&bc.DrainWriters, "drain-writers", 8, "end_to_end_drain: goroutines committing them")
		fs.IntVar(&bc.ConsumerConns, "consumer-conns", 4, "consumer_throughput, end_to_end_drain and memory: database pool of the child processes")
		history := fs.String("history", "10000,1000000", "claim_cost_vs_history: dispatched-row counts (add 10000000 for 10M)")
		fs.IntVar(&bc.ClaimRounds, "claim-rounds", 200, "claim_cost_vs_history: claims timed per history size")
		cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of this process (relays, producer and consumers of the in-process scenarios) to this file, and one per child process (memory, consumer_throughput, end_to_end_drain) beside it (FILE.relay.PID, FILE.consume.PID, FILE.consume-batch.PID), for go tool pprof")
		return func(ctx context.Context, _ []string) (err error) {
			if kind := os.Getenv(bench.ChildEnv); kind != "" {
				// A process of the memory scenario, started by a parent bench.
				cfg, cerr := cli.LoadConfig()
				if cerr != nil {
					return cerr
				}
				logger, lerr := app.NewLogger(cfg, env.Stderr)
				if lerr != nil {
					return lerr
				}
				if p := os.Getenv(bench.ChildProfileEnv); p != "" {
					stop, perr := startCPUProfile(fmt.Sprintf("%s.%s.%d", p, kind, os.Getpid()))
					if perr != nil {
						return perr
					}
					defer stop(&err)
				}
				return bench.Child(ctx, kind, cfg, logger)
			}
			bc.Scenarios = pipeline.SplitList(*scenarios)
			for _, m := range pipeline.SplitList(*relayModes) {
				if m != app.RelayModeNotify && m != app.RelayModeCDC {
					return cli.UsageError{Err: fmt.Errorf("--relay-mode %q: want notify or cdc", m)}
				}
				if m == app.RelayModeCDC {
					bc.RelayModes = append(bc.RelayModes, m)
				}
			}
			if bc.Relays, err = intList(*relays); err != nil {
				return cli.UsageError{Err: fmt.Errorf("--relays: %w", err)}
			}
			if bc.Writers, err = intList(*writers); err != nil {
				return cli.UsageError{Err: fmt.Errorf("--writers: %w", err)}
			}
			if bc.History, err = intList(*history); err != nil {
				return cli.UsageError{Err: fmt.Errorf("--history: %w", err)}
			}
			cfg, logger, err := quietConfig(env.Stderr)
			if err != nil {
				return err
			}
			if *cpuProfile != "" {
				bc.CPUProfile = *cpuProfile
				stop, perr := startCPUProfile(*cpuProfile)
				if perr != nil {
					return perr
				}
				defer stop(&err)
			}
			return bench.Bench(ctx, cfg, bc, env.Stdout, env.Stderr, logger)
		}
	},
}

// startCPUProfile profiles this process into path until stop, which
// reports a failure to write the profile into *err when it had none.
func startCPUProfile(path string) (stop func(err *error), _ error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func(err *error) {
		pprof.StopCPUProfile()
		if cerr := f.Close(); *err == nil && cerr != nil {
			*err = fmt.Errorf("--cpuprofile: %w", cerr)
		}
	}, nil
}

var cmdChaos = &cli.Command{
	Name:    "chaos",
	Summary: "fault-injection run: orders at a steady rate while relay and consumer processes are SIGKILLed, consumers rolled (SIGTERM), database backends terminated, broker connections cut and handlers fail/panic (--network: network faults; --tenants: a tenant fleet over two servers, one killed); exits non-zero if anything was lost, doubled, reordered or crossed between tenants",
	Flags: func(fs *flag.FlagSet, env *cli.Env) cli.RunFunc {
		var run chaos.ChaosRun
		long := fs.Bool("long", false, "the long run: 10,000 orders, broker restarts among the faults")
		fs.IntVar(&run.Orders, "orders", 2000, "orders to place")
		fs.IntVar(&run.Rate, "rate", 200, "create_order calls per second")
		fs.IntVar(&run.Relays, "relays", 2, "ferry relay processes")
		fs.IntVar(&run.Consumers, "consumers", 2, "ferry consume processes")
		seed := fs.Uint64("seed", 1, "seed of the orders and the faults, for replay")
		fs.DurationVar(&run.FaultEvery, "fault-every", 500*time.Millisecond, "pause between injected faults")
		fs.BoolVar(&run.RestartBroker, "restart-broker", false, "also restart RabbitMQ (hits every user of the broker)")
		fs.StringVar(&run.RelayMode, "relay-mode", "notify", "relay processes' mode: notify, or cdc (the CDC variant: the relays stream from a replication slot, one active, one standing by)")
		fs.BoolVar(&run.Versions, "versions", false, "make a version roll the run's only fault: the charge event goes v1 → v2 → v3 while orders flow, the consumers rolled first each time (old and new code at once), then the producers; version 1's code poisons some charges (a bug), which are requeued after version 3 is deployed and must succeed")
		fs.StringVar(&run.Restarts, "restarts", "", "make rolling restarts of the consumers (one at a time, the replacement up first, as a Deployment rolls) the only fault, with this signal: sigterm (a deploy: nothing may run twice) or sigkill; by default a SIGTERM roll is one fault among the others")
		fs.BoolVar(&run.Network, "network", false, "make faults of the network the only faults, from Toxiproxy (in this process): two ferry run processes, A and B, each behind proxies of its own to PostgreSQL and RabbitMQ, meet black holes, 300 ± 200 ms latency, resets, slow closes and bandwidth limits one link at a time; nothing may be poisoned, and the orders committed during a fault must be charged within 15 s (p99). Orders flow (20/s unless --rate) until the plan ends; with --long the plan goes on for 10 minutes")
		fs.BoolVar(&run.HA, "ha", false, "on clusters of the run's own (3 RabbitMQ nodes, a PostgreSQL primary with a synchronous standby, on loopback ports, removed afterwards), with a broker node's loss and a database failover among the faults")
		tenants := fs.Bool("tenants", false, "the tenants run: one fleet of two ferry run processes (FERRY_TENANTS=true) over tenant databases on two PostgreSQL servers of the run's own; orders placed in each tenant's database while members are killed and rolled, their tenant sessions terminated and broker connections cut, handlers fail and panic, a tenant is added, one paused, one drained and removed, and one server is killed for 10 s; checked per tenant: nothing lost, doubled, reordered or crossed into another tenant's database, and the other server's tenants charged meanwhile (p99 at most the outage + 5 s: an ordered partition holding a killed tenant's event waits for it)")
		tenantCount := fs.Int("tenant-count", 4, "with --tenants: how many tenants (4 to 50), half on each server")
		duration := fs.Duration("duration", time.Minute, "with --tenants: how long orders are placed (--long: 10m)")
		asJSON := fs.Bool("json", false, "print the report as JSON")
		return func(ctx context.Context, _ []string) error {
			run.Seed = *seed
			if *tenants {
				set := map[string]bool{}
				fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
				tr := chaos.TenantsRun{Tenants: *tenantCount, Duration: *duration, Seed: *seed, Binary: run.Binary}
				if set["rate"] {
					tr.Rate = run.Rate
				}
				if set["fault-every"] {
					tr.FaultEvery = run.FaultEvery
				}
				if *long && !set["duration"] {
					tr.Duration = 10 * time.Minute
				}
				return chaosTenants(ctx, env, tr, *asJSON)
			}
			if run.Network {
				rateSet := false
				fs.Visit(func(f *flag.Flag) { rateSet = rateSet || f.Name == "rate" })
				if !rateSet {
					run.Rate = 20
				}
				if *long {
					run.NetworkDuration = 10 * time.Minute
				}
			}
			if *long && !run.Network {
				run.Orders = max(run.Orders, 10_000)
				run.RestartBroker = !run.HA // the HA run loses a node of its own cluster instead
			}
			cfg, logger, err := quietConfig(env.Stderr)
			if err != nil {
				return err
			}
			out := env.Stdout
			if *asJSON {
				out = env.Stderr
			}
			rep, err := chaos.Chaos(ctx, cfg, run, out, logger)
			if err != nil {
				return err
			}
			return chaosVerdict(env, rep, rep.Violations, *asJSON)
		}
	},
}

// chaosTenants is `ferry chaos --tenants`.
func chaosTenants(ctx context.Context, env *cli.Env, run chaos.TenantsRun, asJSON bool) error {
	cfg, logger, err := quietConfig(env.Stderr)
	if err != nil {
		return err
	}
	out := env.Stdout
	if asJSON {
		out = env.Stderr
	}
	rep, err := chaos.ChaosTenants(ctx, cfg, run, out, logger)
	if err != nil {
		return err
	}
	return chaosVerdict(env, rep, rep.Violations, asJSON)
}

// chaosVerdict prints a chaos run's report as JSON when asked, and fails
// the command when the run found violations.
func chaosVerdict(env *cli.Env, rep any, violations []string, asJSON bool) error {
	if asJSON {
		if err := cli.WriteJSON(env.Stdout, rep); err != nil {
			return err
		}
	}
	if len(violations) > 0 {
		return fmt.Errorf("%d invariant violation(s): %s", len(violations), violations[0])
	}
	return nil
}

// quietConfig loads the configuration and a logger that prints only
// errors, for commands whose own output is the point (bench, chaos).
func quietConfig(stderr io.Writer) (app.Config, *slog.Logger, error) {
	cfg, err := cli.LoadConfig()
	if err != nil {
		return cfg, nil, err
	}
	logger, err := app.NewLogger(app.Config{LogLevel: "error", LogFormat: cfg.LogFormat}, stderr)
	return cfg, logger, err
}

func intList(s string) ([]int, error) {
	var out []int
	for _, p := range pipeline.SplitList(s) {
		n, err := strconv.Atoi(p)
		if err != nil {
			return nil, fmt.Errorf("%q is not a whole number", p)
		}
		out = append(out, n)
	}
	return out, nil
}
