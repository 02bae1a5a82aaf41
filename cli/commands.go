package cli

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/ferry-dev/ferry/adoption/backfill"
	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/agenttools/mcptools"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/internal/attention"
	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

var (
	cmdRun = &Command{Name: "run", Summary: "run the relay, the consumers, the HTTP API (if the application has one) and the hourly pruning in one process",
		Flags: serveFlags(app.All)}
	cmdRelay = &Command{Name: "relay", Summary: "run only the outbox relay (run several for throughput and failover)",
		Flags: serveFlags(app.Components{Relay: true})}
	cmdConsume = &Command{Name: "consume", Summary: "run only the consumers (every handler of the route table)",
		Flags: serveFlags(app.Components{Consumers: true})}
	cmdServe = &Command{Name: "serve", Summary: "run only the application's HTTP API and agent tool endpoints (it writes to the outbox; relays and consumers run elsewhere)",
		Flags: serveFlags(app.Components{HTTP: true})}
	cmdMigrate = &Command{Name: "migrate", Summary: "apply, roll back or list database migrations (Ferry's, then the application's)", Sub: []*Command{
		{Name: "up", Summary: "apply every pending migration", Flags: migrateFlags("up")},
		{Name: "down", Summary: "roll back the newest applied migration (of the application's sets first)", Flags: migrateFlags("down")},
		{Name: "status", Summary: "list migrations and whether each is applied", Flags: migrateFlags("status")},
	}}
	cmdStatus = &Command{Name: "status", Summary: "pending per topic, oldest pending, rows failing with their last error, retries, held partitions, broker queues, poison and unrouted depth, relay/consumer liveness; exits 3 when something needs a human",
		Flags: statusFlags}
	cmdPoison = &Command{Name: "poison", Summary: "inspect and act on the poison store", Sub: []*Command{
		{Name: "list", Summary: "what is in the poison store, why, since when (paged by id, streamed)", Flags: poisonFlags("list")},
		{Name: "show", Args: "ID", Summary: "one poisoned message whole: full reason, attempt history, headers, payload", Flags: poisonShowFlags},
		{Name: "requeue", Summary: "send poisoned messages back to their original topic (attempts reset), atomically: an interrupted requeue loses and doubles nothing",
			Flags: poisonFlags("requeue")},
		{Name: "discard", Summary: "delete poisoned messages; unknown ids are named and fail the command", Flags: poisonFlags("discard")},
	}}
	cmdPrune = &Command{Name: "prune", Summary: "remove rows past their retention", Sub: []*Command{
		{Name: "outbox", Summary: "remove (or archive) dispatched outbox rows past their retention", Flags: pruneFlags(pgretention.Outbox)},
		{Name: "ledger", Summary: "remove consumer ledger rows past their retention", Flags: pruneFlags(pgretention.Ledger)},
		{Name: "tool-calls", Summary: "remove agent tool call records (idempotency) past their retention", Flags: pruneFlags(pgretention.ToolCalls)},
	}}
	cmdMCP = &Command{Name: "mcp", Summary: "serve the application's agent tools over MCP on stdin/stdout, for a host that starts it as a subprocess",
		Long: `Logs go to stderr; stdout carries only MCP. The idempotency key of a call
comes from the request's _meta "dev.ferry/idempotency-key", set by the
host. The same tools are served over streamable HTTP at /mcp on the API
server (the run command), and as plain JSON at POST /tools/{name}.`,
		Flags: mcpFlags}
	cmdShadow = &Command{Name: "shadow", Summary: "shadow mode (adopting Ferry in a running service): compare intents with legacy effects", Sub: []*Command{
		{Name: "report", Summary: "per topic: shadow intents vs legacy effects, matched, and the aggregates missing on each side; exits 1 on a mismatch",
			Flags: shadowReportFlags},
	}}
	cmdBackfill = &Command{Name: "backfill", Summary: "write intents for existing rows the legacy system never handled: a dry run unless --apply, capped by --max, spread over time, resumable",
		Long: `The query (run in a READ ONLY transaction) returns aggregate_id, payload
(json, jsonb or JSON text) and optionally headers (a JSON object of strings),
one row per aggregate. Without --apply nothing is written: the dry run says
how many intents would be written, shows three, how many an earlier run of
the same --name wrote, and the schedule. Re-running the same --name writes
no intent twice; an interrupted run continues where it stopped.`,
		Flags: backfillFlags}
	cmdCDC = &Command{Name: "cdc", Summary: "the CDC relay's replication slot and publication", Sub: []*Command{
		{Name: "drop", Summary: "remove the slot and the publication (switching CDC off for good: a slot nobody streams retains WAL)", Flags: cdcDropFlags},
	}}
	cmdAudit       = &Command{Name: "audit", Summary: "the audit log: who requeued, retried or discarded what, when, how many, with the ids (console and CLI)", Flags: auditFlags}
	cmdHealthcheck = &Command{Name: "healthcheck", Summary: "exit 0 if the admin server's /readyz (or --url) answers 200; for container healthchecks, the image having no shell or curl",
		Flags: healthcheckFlags}
)

func serveFlags(what app.Components) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		migrate := fs.Bool("migrate", false, "apply pending migrations at start instead of refusing to start")
		var mode *string
		if what.Relay {
			mode = fs.String("mode", "", "relay mode: notify, poll or cdc (stream the outbox from the WAL); overrides FERRY_RELAY_MODE")
		}
		return func(ctx context.Context, _ []string) error {
			var set func(*app.Config)
			if mode != nil && *mode != "" {
				switch *mode {
				case app.RelayModeNotify, app.RelayModePoll, app.RelayModeCDC:
				default:
					return usagef("--mode must be %s, %s or %s, got %q", app.RelayModeNotify, app.RelayModePoll, app.RelayModeCDC, *mode)
				}
				set = func(c *app.Config) { c.RelayMode = *mode }
			}
			// The producers' side needs no broker: orders are taken (into
			// the outbox) while it is down, as the outbox promises.
			withoutBroker := !what.Relay && !what.Consumers
			a, logger, err := env.newApp(ctx, *migrate, nil, withoutBroker, set)
			if err != nil {
				return err
			}
			defer a.Close()
			logger.Info(env.Name+" started", "components", what, "version", env.Options.Version)
			return a.Run(ctx, what, nil)
		}
	}
}

// newApp builds the application from the FERRY_* configuration and the
// binary's options, logging to logTo (nil: standard error).
func (e *Env) newApp(ctx context.Context, migrate bool, logTo io.Writer, withoutBroker bool, set func(*app.Config)) (*app.App, *slog.Logger, error) {
	cfg, err := LoadConfig()
	if err != nil {
		return nil, nil, err
	}
	if set != nil {
		set(&cfg)
	}
	logger, err := app.NewLogger(cfg, logTo)
	if err != nil {
		return nil, nil, err
	}
	opts, err := e.appOptions()
	if err != nil {
		return nil, nil, err
	}
	opts.Migrate = opts.Migrate || migrate
	opts.Logger, opts.Version = logger, e.Options.Version
	opts.WithoutBroker = opts.WithoutBroker || withoutBroker
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		return nil, nil, err
	}
	return a, logger, nil
}

// OpenPool connects to the configured database and schema (no broker
// needed), and checks that Ferry's migrations are applied there.
func OpenPool(ctx context.Context, name string) (*pgxpool.Pool, error) {
	_, pool, err := openMigrated(ctx, name)
	return pool, err
}

// ErrNotMigrated says the configured schema lacks Ferry's tables.
var ErrNotMigrated = errors.New("not migrated")

// openMigrated is openConfigured for the commands that read Ferry's
// tables: on a schema that lacks them (never migrated, or the wrong
// FERRY_DATABASE_SCHEMA) it fails with one line that says what to do,
// before printing anything, instead of a driver's "relation does not
// exist" halfway through.
func openMigrated(ctx context.Context, name string) (app.Config, *pgxpool.Pool, error) {
	cfg, pool, err := openConfigured(ctx, name)
	if err != nil {
		return cfg, pool, err
	}
	missing, err := migrations.MissingTables(ctx, pool, migrations.ReadTables)
	if err == nil && len(missing) == 0 {
		return cfg, pool, nil
	}
	pool.Close()
	schema := cfg.DatabaseSchema
	if schema == "" {
		schema = "public"
	}
	if err != nil {
		return cfg, nil, fmt.Errorf("checking for Ferry's tables in schema %q: %w", schema, err)
	}
	return cfg, nil, fmt.Errorf("%w: schema %q has no %s; run `%s migrate up` with the FERRY_DATABASE_URL and FERRY_DATABASE_SCHEMA of your service (is FERRY_DATABASE_SCHEMA the one it uses?)",
		ErrNotMigrated, schema, strings.Join(missing, ", "), binaryName)
}

// openConfigured loads the configuration and connects with it, for the
// commands that need both.
func openConfigured(ctx context.Context, name string) (app.Config, *pgxpool.Pool, error) {
	cfg, err := LoadConfig()
	if err != nil {
		return cfg, nil, err
	}
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-" + name, MaxConns: 2})
	return cfg, pool, err
}

// WriteJSON writes v indented, for --json output.
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func migrateFlags(verb string) func(*flag.FlagSet, *Env) RunFunc {
	return func(_ *flag.FlagSet, env *Env) RunFunc {
		return func(ctx context.Context, _ []string) error {
			cfg, err := LoadConfig()
			if err != nil {
				return err
			}
			sets, err := env.migrationSets()
			if err != nil {
				return err
			}
			pool, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-migrate"})
			if err != nil {
				return err
			}
			defer pool.Close()
			db := pgdb.SQLDB(pool)
			defer db.Close()
			switch verb {
			case "up":
				if cfg.DatabaseSchema != "" {
					if err := pgdb.EnsureSchema(ctx, pool, cfg.DatabaseSchema); err != nil {
						return err
					}
				}
				for _, s := range sets {
					n, err := s.Up(ctx, db)
					if err != nil {
						return err
					}
					fmt.Fprintf(env.Stdout, "%s: applied %d migration(s)\n", s.Name, n)
				}
			case "down":
				// The application's tables sit on Ferry's: roll back the
				// newest set that has something applied.
				for i := len(sets) - 1; i >= 0; i-- {
					states, err := sets[i].Status(ctx, db)
					if err != nil {
						return err
					}
					applied := false
					for _, st := range states {
						applied = applied || st.Applied
					}
					if !applied {
						continue
					}
					if err := sets[i].Down(ctx, db); err != nil {
						return err
					}
					fmt.Fprintf(env.Stdout, "%s: rolled back 1 migration\n", sets[i].Name)
					return nil
				}
				fmt.Fprintln(env.Stdout, "nothing to roll back")
			case "status":
				for _, s := range sets {
					states, err := s.Status(ctx, db)
					if err != nil {
						return err
					}
					for _, st := range states {
						mark := "pending"
						if st.Applied {
							mark = "applied"
						}
						fmt.Fprintf(env.Stdout, "%-16s %05d  %-8s %s\n", s.Name, st.Version, mark, st.Name)
					}
				}
			}
			return nil
		}
	}
}

// ExitAttention is `status`'s exit code when the report was made and
// something in it needs a human.
const ExitAttention = 3

// statusReport is `ferry status`'s report: the database's view, the
// broker's unrouted queue, and what needs a human.
type statusReport struct {
	pgstatus.Report
	// Unrouted is the depth of the broker's unrouted queue; nil when the
	// broker could not be asked (BrokerError says why).
	Unrouted    *int   `json:"unrouted"`
	BrokerError string `json:"broker_error,omitempty"`
	// Queues are the route table's queues (ready messages, consumers);
	// absent when the binary has no route table or the broker was not
	// reachable.
	Queues []rabbit.QueueStat `json:"queues,omitempty"`
	// QueuesError is why the route table's queues could not be read.
	QueuesError string `json:"queues_error,omitempty"`
	// UnroutedError is why the unrouted queue could not be read while the
	// broker answered (it does not exist yet).
	UnroutedError string `json:"unrouted_error,omitempty"`
	// Attention lists what needs a human; empty when all is well.
	Attention []string `json:"attention"`
	// Audit is the newest entries of the audit log (ferry audit).
	Audit []pgaudit.Entry `json:"audit"`
	// CDC is the CDC relay's replication slot, when relay mode is cdc or
	// the slot exists.
	CDC *pgcdc.SlotStatus `json:"cdc,omitempty"`
}

func cdcDropFlags(fs *flag.FlagSet, env *Env) RunFunc {
	slot := fs.String("slot", "", "slot name (default: FERRY_CDC_SLOT, or ferry_<database>_<schema>)")
	publication := fs.String("publication", "", "publication name (default: FERRY_CDC_PUBLICATION, or the slot's name)")
	return func(ctx context.Context, _ []string) error {
		cfg, pool, err := openConfigured(ctx, "cdc")
		if err != nil {
			return err
		}
		defer pool.Close()
		c := cfg.CDC
		if *slot != "" {
			c.Slot = *slot
		}
		if *publication != "" {
			c.Publication = *publication
		}
		for name, v := range map[string]string{"--slot": c.Slot, "--publication": c.Publication} {
			if v != "" {
				if err := pgcdc.ValidateName(v); err != nil {
					return usagef("%s %v", name, err)
				}
			}
		}
		s, p, err := pgcdc.Names(ctx, pool, c)
		if err != nil {
			return err
		}
		droppedSlot, droppedPub, err := pgcdc.Drop(ctx, pool, s, p)
		if err != nil {
			return err
		}
		fmt.Fprintf(env.Stdout, "replication slot %s: %s\npublication %s: %s\n", s, droppedWord(droppedSlot), p, droppedWord(droppedPub))
		return nil
	}
}

func droppedWord(dropped bool) string {
	if dropped {
		return "dropped"
	}
	return "not there"
}

func statusFlags(fs *flag.FlagSet, env *Env) RunFunc {
	asJSON := fs.Bool("json", false, "print JSON")
	threshold := fs.Int("attempts", pgstatus.DefaultAttemptsThreshold, "list rows with more relay attempts than this")
	exitCode := fs.Bool("exit-code", true, fmt.Sprintf("exit %d when something needs a human (the broker unreachable, no live relay, a held partition, a queue with messages and no consumer, poisoned, retrying or unrouted messages, rows past --attempts); false: exit 0 whenever the report is printed", ExitAttention))
	return func(ctx context.Context, _ []string) error {
		if *threshold < 0 {
			return usagef("--attempts must not be negative")
		}
		cfg, pool, err := openMigrated(ctx, "status")
		if err != nil {
			return err
		}
		defer pool.Close()
		rep := statusReport{Attention: []string{}}
		if rep.Report, err = pgstatus.Collect(ctx, pool, pgoutbox.DefaultTable, *threshold); err != nil {
			return err
		}
		if err := inspectBroker(ctx, cfg, env, &rep); err != nil {
			rep.BrokerError = pipeline.CleanText(err.Error(), 300)
		}
		if rep.CDC, err = cdcSlot(ctx, cfg, pool); err != nil {
			return err
		}
		rep.Attention = attention.List(attention.State{Report: rep.Report, BrokerError: rep.BrokerError, Unrouted: rep.Unrouted,
			Queues: rep.Queues, CDC: rep.CDC, Command: binaryName})
		if rep.Audit, err = pgaudit.List(ctx, pool, 20); err != nil {
			return err
		}
		if *asJSON {
			err = WriteJSON(env.Stdout, rep)
		} else {
			err = printStatus(env.Stdout, rep)
		}
		if err != nil {
			return err
		}
		if *exitCode && len(rep.Attention) > 0 {
			return ExitError{Code: ExitAttention}
		}
		return nil
	}
}

// cdcSlot reads the configured (or default) CDC slot: nil when relay mode
// is not cdc and there is no such slot.
func cdcSlot(ctx context.Context, cfg app.Config, pool *pgxpool.Pool) (*pgcdc.SlotStatus, error) {
	slot, _, err := pgcdc.Names(ctx, pool, cfg.CDC)
	if err != nil {
		return nil, err
	}
	st, err := pgcdc.ReadSlot(ctx, pool, slot)
	if err != nil {
		return nil, err
	}
	if !st.Exists && cfg.RelayMode != app.RelayModeCDC {
		return nil, nil
	}
	return &st, nil
}

// inspectBroker asks the broker, briefly, how many messages its unrouted
// queue holds and, when the binary has a route table, what each of the
// route table's queues holds and who consumes it. The route table comes
// from the application's own options, built without a broker connection:
// a passive declare reads a queue and never creates one, so status
// changes nothing on the broker.
func inspectBroker(ctx context.Context, cfg app.Config, env *Env, rep *statusReport) error {
	topo, err := rabbit.NewTopology(cfg.AMQP)
	if err != nil {
		return err
	}
	amqpCfg := cfg.AMQP
	amqpCfg.DialTimeout = 3 * time.Second
	uri, conf := rabbit.AMQPConfig(amqpCfg, "ferry-status")
	conn, err := amqp.DialConfig(uri, conf)
	if err != nil {
		return fmt.Errorf("cannot reach RabbitMQ: %s", amqpReason(err))
	}
	defer conn.Close()
	unrouted := topo.QueueName(rabbit.UnroutedName)
	n, err := rabbit.QueueDepth(conn, unrouted)
	switch {
	case rabbit.IsQueueMissing(err):
		// The broker answered: a queue not declared yet is not an
		// unreachable broker.
		rep.UnroutedError = fmt.Sprintf("the queue %s does not exist: no relay has declared Ferry's topology on this broker and vhost (FERRY_AMQP_URL, FERRY_AMQP_NAMESPACE) yet; start %s relay", unrouted, binaryName)
	case err != nil:
		return err
	default:
		rep.Unrouted = &n
	}
	if env.Options.App == nil {
		return nil
	}
	// What goes wrong from here is about the queues only: the broker
	// answered, so it is not reported as unreachable.
	queues, err := routeQueues(ctx, cfg, env, conn)
	if err != nil {
		rep.QueuesError = pipeline.CleanText(err.Error(), 300)
	}
	rep.Queues = queues
	return nil
}

func routeQueues(ctx context.Context, cfg app.Config, env *Env, conn *amqp.Connection) ([]rabbit.QueueStat, error) {
	opts, err := env.Options.App()
	if err != nil {
		return nil, fmt.Errorf("building the application's options: %w", err)
	}
	opts.WithoutBroker, opts.Migrate = true, false
	opts.Logger = slog.New(slog.DiscardHandler)
	opts.TracerProvider = noop.NewTracerProvider()
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		return nil, fmt.Errorf("reading the route table: %w", err)
	}
	defer a.Close()
	return a.QueueStatsOn(conn)
}

// amqpReason keeps credentials out of a dial error's text.
func amqpReason(err error) string {
	var ae *amqp.Error
	if errors.As(err, &ae) {
		return ae.Reason
	}
	return err.Error()
}

func printStatus(w io.Writer, rep statusReport) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "outbox: %d pending, oldest due %s\n", rep.PendingTotal, time.Duration(rep.OldestDueAgeS*float64(time.Second)).Round(time.Millisecond))
	if len(rep.Backlog) > 0 {
		fmt.Fprintln(tw, "  TOPIC\tPENDING\tDUE\tDELAYED\tOLDEST DUE\tMAX ATTEMPTS")
		for _, b := range rep.Backlog {
			fmt.Fprintf(tw, "  %s\t%d\t%d\t%d\t%s\t%d\n", cell(b.Topic, maxIDCell), b.Pending, b.Due, b.Delayed,
				time.Duration(b.OldestDueAgeS*float64(time.Second)).Round(time.Millisecond), b.MaxAttempts)
		}
	}
	fmt.Fprintf(tw, "rows with more than %d attempts: %d\n", rep.AttemptsThreshold, len(rep.Failing))
	for _, f := range rep.Failing {
		fmt.Fprintf(tw, "  #%d\t%s\t%s\tattempts %d\tnext %s\t%s\n", f.ID, cell(f.Topic, maxIDCell), cell(f.AggregateID, maxIDCell), f.Attempts,
			f.AvailableAt.Format(time.RFC3339), cell(f.LastError, maxReasonCell))
	}
	fmt.Fprintf(tw, "durable retries: %d message(s) waiting for their handler\n", rep.RetryingTotal)
	if len(rep.Retrying) > 0 {
		fmt.Fprintln(tw, "  HANDLER\tCOUNT\tNEXT ATTEMPT\tNEXT TRY\tFAILING SINCE\tLAST ERROR")
		for _, g := range rep.Retrying {
			fmt.Fprintf(tw, "  %s\t%d\t%d\t%s\t%s\t%s\n", cell(g.Handler, maxIDCell), g.Count, g.MaxAttempt,
				g.NextTry.UTC().Format(time.RFC3339), g.FirstFailed.UTC().Format(time.RFC3339), cell(g.Example, maxReasonCell))
		}
	}
	if len(rep.Held) > 0 {
		fmt.Fprintf(tw, "held ordered partitions: %d\n", len(rep.Held))
		fmt.Fprintln(tw, "  PARTITION\tHELD SINCE\tBEHIND MESSAGE\tNEXT ATTEMPT\tLAST ERROR")
		for _, h := range rep.Held {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%s\n", cell(h.Consumer, maxIDCell), h.Since.UTC().Format(time.RFC3339), cell(h.MessageID, maxIDCell), h.Attempt, cell(h.LastError, maxReasonCell))
		}
	}
	fmt.Fprintf(tw, "poison store: %d message(s)\n", rep.PoisonTotal)
	topics := make([]string, 0, len(rep.Poison))
	for t := range rep.Poison {
		topics = append(topics, t)
	}
	sort.Strings(topics)
	for _, t := range topics {
		fmt.Fprintf(tw, "  %s\t%d\n", cell(t, maxIDCell), rep.Poison[t])
	}
	if rep.QueuesError != "" {
		fmt.Fprintf(tw, "broker queues: unknown: %s\n", cell(rep.QueuesError, maxReasonCell))
	}
	if len(rep.Queues) > 0 {
		fmt.Fprintln(tw, "broker queues:")
		fmt.Fprintln(tw, "  QUEUE\tREADY\tCONSUMERS")
		for _, q := range rep.Queues {
			fmt.Fprintf(tw, "  %s\t%d\t%d\n", cell(q.Queue, maxTextCell), q.Ready, q.Consumers)
		}
	}
	if rep.Unrouted != nil {
		fmt.Fprintf(tw, "unrouted (broker): %d message(s)\n", *rep.Unrouted)
	} else {
		fmt.Fprintf(tw, "unrouted (broker): unknown: %s\n", cell(cmp.Or(rep.UnroutedError, rep.BrokerError), maxReasonCell))
	}
	if c := rep.CDC; c != nil {
		if c.Exists {
			state := "not streamed"
			if c.Active {
				state = fmt.Sprintf("streamed by walsender pid %d", c.ActivePID)
			}
			fmt.Fprintf(tw, "cdc slot %s: %s, confirmed %s, lag %d bytes, retained WAL %d bytes, wal_status %s\n",
				c.Name, state, c.ConfirmedLSN, c.LagBytes, c.RetainedBytes, cell(c.WALStatus, maxIDCell))
		} else {
			fmt.Fprintf(tw, "cdc slot %s: does not exist\n", c.Name)
		}
	}
	fmt.Fprintf(tw, "processes: %d relay(s) and %d consumer(s) alive\n", rep.RelaysAlive, rep.ConsumersAlive)
	for _, in := range rep.Instances {
		state := "alive"
		if !in.Alive {
			state = "DEAD (no heartbeat)"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s pid %d\t%s\tlast heartbeat %s ago\t%s\n", cell(in.ID, maxIDCell), cell(in.Components, maxTextCell),
			cell(in.Hostname, maxIDCell), in.PID, cell(in.Version, maxIDCell), rep.At.Sub(in.HeartbeatAt).Round(time.Second), state)
	}
	if len(rep.Attention) == 0 {
		fmt.Fprintln(tw, "needs attention: nothing")
	} else {
		fmt.Fprintln(tw, "needs attention:")
		for _, a := range rep.Attention {
			fmt.Fprintf(tw, "  - %s\n", a)
		}
	}
	return tw.Flush()
}

// CDCRetainedAttention is how much WAL an idle CDC slot may retain before
// status lists it under "needs attention".
const CDCRetainedAttention = attention.CDCRetained

// DefaultActionLimit caps a requeue or discard unless --limit says
// otherwise: a mistyped --all does not resend a whole store at once.
const DefaultActionLimit = 1000

func poisonFlags(sub string) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		var (
			sel         pgpoison.Selector
			ids, filter string
			asJSON, dry bool
			group       bool
		)
		fs.BoolVar(&asJSON, "json", false, "print JSON (exact, unescaped and uncut)")
		fs.StringVar(&filter, "filter", "", "narrow by handler=H,aggregate=A,text=T,fingerprint=F,correlation=C,message=M,since=24h|RFC3339,until=… (comma-separated; as the console's filters)")
		fs.Int64Var(&sel.AfterID, "after-id", 0, "start after this poison id (the next page)")
		if sub == "list" {
			fs.StringVar(&sel.Topic, "topic", "", "only this original topic")
			fs.IntVar(&sel.Limit, "limit", 50, fmt.Sprintf("at most this many, oldest first (0: all, streamed; at most %d)", pgpoison.MaxLimit))
			fs.BoolVar(&group, "group", false, "group by error fingerprint (the reason with ids, numbers and addresses normalised away): count, first and last seen, an example")
		} else {
			fs.StringVar(&ids, "id", "", "poison ids, comma-separated")
			fs.StringVar(&sel.Topic, "topic", "", "every message of this original topic")
			fs.BoolVar(&sel.All, "all", false, "every message")
			fs.IntVar(&sel.Limit, "limit", DefaultActionLimit, fmt.Sprintf("at most this many, oldest first (0: no cap; at most %d)", pgpoison.MaxLimit))
			fs.BoolVar(&dry, "dry-run", false, "take the same steps and checks, then roll back: say what would happen, change nothing")
		}
		return func(ctx context.Context, _ []string) error {
			for _, p := range strings.Split(ids, ",") {
				if p = strings.TrimSpace(p); p == "" {
					continue
				}
				id, err := strconv.ParseInt(p, 10, 64)
				if err != nil || id <= 0 {
					return usagef("--id: %q is not a poison id", p)
				}
				sel.IDs = append(sel.IDs, id)
			}
			if filter != "" {
				f, err := ParseFilter(filter)
				if err != nil {
					return UsageError{fmt.Errorf("--filter: %w", err)}
				}
				sel.Filter = f // --topic stays Selector.Topic
			}
			// What list reads: the filter with --topic and the paging flags.
			lf := sel.Filter
			lf.Topic, lf.AfterID, lf.Limit = sel.Topic, sel.AfterID, sel.Limit
			// Refuse bad flags before connecting, let alone changing anything.
			check := sel.Validate
			if sub == "list" {
				check = lf.Validate
			}
			if err := check(); err != nil {
				return UsageError{flagNames(err)}
			}
			store, closeStore, err := openPoisonStore(ctx)
			if err != nil {
				return err
			}
			defer closeStore()
			out := env.Stdout
			if sub == "list" && group {
				return listGroups(ctx, out, store, lf, asJSON)
			}
			if sub == "list" {
				return listPoison(ctx, out, store, lf, asJSON)
			}
			act := store.RequeueEach
			verb, dryVerb := "requeued", "would requeue"
			if sub == "discard" {
				act, verb, dryVerb = store.DiscardEach, "discarded", "would discard"
			}
			if dry {
				verb = dryVerb
			}
			// Each page's audit entry is written in the page's transaction.
			err = streamActions(out, asJSON, verb, func(fn func(pgpoison.Action) error) (pgpoison.Summary, error) {
				return act(ctx, sel, pgpoison.Run{DryRun: dry, Actor: pgaudit.CLIActor()}, fn)
			})
			return err
		}
	}
}

// ParseFilter reads --filter: key=value pairs, comma-separated (handler,
// aggregate, text, fingerprint, since, until; since and until take a
// duration back from now or an RFC 3339 time).
func ParseFilter(v string) (pgpoison.Filter, error) {
	var f pgpoison.Filter
	for _, part := range strings.Split(v, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		k, val, ok := strings.Cut(part, "=")
		if !ok {
			return f, fmt.Errorf("want key=value, got %q", part)
		}
		switch k {
		case "handler":
			f.Handler = val
		case "aggregate":
			f.AggregateID = val
		case "text":
			f.Text = val
		case "fingerprint":
			f.Fingerprint = val
		case "correlation":
			f.CorrelationID = val
		case "message":
			f.MessageID = val
		case "since", "until":
			t, err := timeOrAgo(val)
			if err != nil {
				return f, fmt.Errorf("%s: %w", k, err)
			}
			if k == "since" {
				f.Since = t
			} else {
				f.Until = t
			}
		default:
			return f, fmt.Errorf("unknown key %q (handler, aggregate, text, fingerprint, correlation, message, since, until)", k)
		}
	}
	return f, nil
}

func timeOrAgo(v string) (time.Time, error) {
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return time.Now().Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return t, errors.New("want a duration back from now (24h) or an RFC 3339 time")
	}
	return t, nil
}

func listGroups(ctx context.Context, w io.Writer, store *pgpoison.Store, f pgpoison.Filter, asJSON bool) error {
	f.AfterID, f.Limit = 0, 0
	groups, err := store.Groups(ctx, f, 0)
	if err != nil {
		return err
	}
	if asJSON {
		return WriteJSON(w, groups)
	}
	if len(groups) == 0 {
		fmt.Fprintln(w, "(no poisoned messages)")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNT\tHANDLERS\tFIRST SEEN\tLAST SEEN\tFINGERPRINT\tEXAMPLE")
	for _, g := range groups {
		fmt.Fprintf(tw, "%d\t%s\t%s ago\t%s ago\t%s\t%s\n", g.Count, cell(g.Handlers, maxIDCell), time.Since(g.FirstSeen).Round(time.Second),
			time.Since(g.LastSeen).Round(time.Second), cell(g.Fingerprint, maxReasonCell), cell(g.Example, maxTextCell))
	}
	fmt.Fprintf(tw, "(act on a group: %s poison requeue --filter 'fingerprint=<FINGERPRINT>' --dry-run)\n", binaryName)
	return tw.Flush()
}

// flagNames says "--limit" and "--after-id" where the store says "limit".
func flagNames(err error) error {
	msg := strings.NewReplacer("limit must", "--limit must", "after-id must", "--after-id must").Replace(err.Error())
	return errors.New(msg)
}

func openPoisonStore(ctx context.Context) (*pgpoison.Store, func(), error) {
	pool, err := OpenPool(ctx, "poison")
	if err != nil {
		return nil, nil, err
	}
	outbox, err := pgoutbox.New(pgoutbox.Config{}, nil)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	store, err := pgpoison.NewStore(pool, outbox)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return store, pool.Close, nil
}

// listPoison streams the store: a page at a time from the database, a
// record at a time to the output, whatever --limit.
func listPoison(ctx context.Context, w io.Writer, store *pgpoison.Store, f pgpoison.Filter, asJSON bool) error {
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	n := 0
	if asJSON {
		bw.WriteString("[")
		err := store.Each(ctx, f, func(r pgpoison.Record) error {
			if n > 0 {
				bw.WriteString(",")
			}
			n++
			bw.WriteString("\n  ")
			return writeJSONLine(bw, r)
		})
		if n > 0 {
			bw.WriteString("\n")
		}
		bw.WriteString("]\n")
		return err
	}
	total, err := store.Count(ctx, f)
	if err != nil {
		return err
	}
	tw := poisonTable(bw)
	widths := listWidths()
	var last int64
	err = store.Each(ctx, f, func(r pgpoison.Record) error {
		n++
		last = r.ID
		poisonRow(tw, r, widths)
		if n%100 == 0 {
			return tw.Flush() // column widths per 100 rows; memory stays flat
		}
		return nil
	})
	if n == 0 {
		fmt.Fprintf(bw, "(no poisoned messages%s)\n", map[bool]string{true: " under this filter", false: ""}[f.String() != ""])
		return err
	}
	if ferr := tw.Flush(); err == nil {
		err = ferr
	}
	// The total under the filter, and how to read on: the page ends at
	// --limit, and --after-id starts the next one.
	if f.AfterID > 0 {
		fmt.Fprintf(bw, "%d shown, after id %d, of %d under the filter", n, f.AfterID, total)
	} else {
		fmt.Fprintf(bw, "%d shown of %d under the filter", n, total)
	}
	if f.Limit > 0 && n == f.Limit {
		fmt.Fprintf(bw, "; next page: the same command with --after-id %d", last)
	}
	fmt.Fprintln(bw)
	return err
}

// cellWidths are the widths a poison table's cells are cut to.
type cellWidths struct{ id, reason int }

// listWidths fits the table to the terminal when COLUMNS says how wide it
// is (shells set it): the id columns shrink to an eighth of it, the reason
// takes what is left; without it, the defaults.
func listWidths() cellWidths {
	w := cellWidths{id: maxIDCell, reason: maxReasonCell}
	cols, err := strconv.Atoi(os.Getenv("COLUMNS"))
	if err != nil || cols <= 0 {
		return w
	}
	w.id = min(max(cols/8, 8), maxIDCell)
	w.reason = min(max(cols-3*w.id-60, 20), maxReasonCell)
	return w
}

// streamActions prints each requeued or discarded message as it is done,
// then the summary; it fails (exit 1) when ids were not found or messages
// were skipped, saying which.
func streamActions(w io.Writer, asJSON bool, verb string, run func(func(pgpoison.Action) error) (pgpoison.Summary, error)) error {
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	n := 0
	var sum pgpoison.Summary
	var err error
	if asJSON {
		bw.WriteString(`{"actions": [`)
		sum, err = run(func(a pgpoison.Action) error {
			if n > 0 {
				bw.WriteString(",")
			}
			n++
			bw.WriteString("\n  ")
			return writeJSONLine(bw, a)
		})
		if err != nil {
			return err
		}
		bw.WriteString("\n], \"summary\": ")
		if err := writeJSONLine(bw, sum); err != nil {
			return err
		}
		bw.WriteString("}\n")
	} else {
		tw := poisonTable(bw)
		var skipped []pgpoison.Action
		sum, err = run(func(a pgpoison.Action) error {
			if !a.Done {
				skipped = append(skipped, a)
				return nil
			}
			n++
			poisonRow(tw, a.Record, listWidths())
			if n%100 == 0 {
				return tw.Flush()
			}
			return nil
		})
		if ferr := tw.Flush(); err == nil {
			err = ferr
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(bw, "%s %d message(s)\n", verb, sum.Done)
		for _, a := range skipped {
			fmt.Fprintf(bw, "skipped poison id %d: %s\n", a.Record.ID, cell(a.Why, 300))
		}
		if sum.LastID > 0 {
			fmt.Fprintf(bw, "last poison id looked at: %d (--after-id %d continues)\n", sum.LastID, sum.LastID)
		}
	}
	var problems []string
	if len(sum.NotFound) > 0 {
		problems = append(problems, fmt.Sprintf("no poisoned message with id %s", joinIDs(sum.NotFound)))
	}
	if sum.Skipped > 0 {
		problems = append(problems, fmt.Sprintf("%d message(s) skipped", sum.Skipped))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}

func writeJSONLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

func poisonTable(w io.Writer) *tabwriter.Writer {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTOPIC\tHANDLER\tMESSAGE\tATTEMPTS\tFIRST FAILED\tPOISONED\tREASON")
	return tw
}

func poisonRow(tw io.Writer, r pgpoison.Record, w cellWidths) {
	fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s ago\t%s ago\t%s\n", r.ID, cell(r.Topic, w.id), cell(r.Handler, w.id),
		cell(r.MessageID, w.id), r.Attempts, display.Age(time.Since(r.FirstFailedAt)), display.Age(time.Since(r.PoisonedAt)),
		cell(r.Reason, w.reason))
}

func poisonShowFlags(fs *flag.FlagSet, env *Env) RunFunc {
	asJSON := fs.Bool("json", false, "print JSON (exact)")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one poison id")
		}
		id, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil || id <= 0 {
			return usagef("%q is not a poison id", args[0])
		}
		store, closeStore, err := openPoisonStore(ctx)
		if err != nil {
			return err
		}
		defer closeStore()
		r, err := store.Get(ctx, id)
		if err != nil {
			return err
		}
		if *asJSON {
			return WriteJSON(env.Stdout, r)
		}
		printPoisonRecord(env.Stdout, r)
		return nil
	}
}

// printPoisonRecord shows one message whole: nothing cut but the attempt
// errors' own limits, every control character escaped.
func printPoisonRecord(w io.Writer, r pgpoison.Record) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	field := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, escapeText(v, false)) }
	field("poison id", strconv.FormatInt(r.ID, 10))
	field("message id", r.MessageID)
	field("topic", r.Topic)
	field("handler", r.Handler+" ("+r.Consumer+")")
	field("aggregate id", r.AggregateID)
	field("correlation id", r.CorrelationID)
	field("trace id", r.Headers[pipeline.MetaTraceID])
	field("attempts", strconv.Itoa(r.Attempts))
	field("permanent", strconv.FormatBool(r.Permanent))
	field("first failed", r.FirstFailedAt.Format(time.RFC3339))
	field("last failed", r.LastFailedAt.Format(time.RFC3339))
	field("poisoned", r.PoisonedAt.Format(time.RFC3339))
	_ = tw.Flush()
	fmt.Fprintf(w, "\nreason:\n  %s\n", escapeText(r.Reason, false))
	if hist := pipeline.ErrorHistory(r.Headers); len(hist) > 0 {
		fmt.Fprintf(w, "\nattempt history (newest last):\n")
		for _, h := range hist {
			fmt.Fprintf(w, "  #%d  %s  %s\n", h.Attempt, escapeText(h.At, false), escapeText(h.Error, false))
		}
	}
	fmt.Fprintf(w, "\nheaders:\n")
	keys := make([]string, 0, len(r.Headers))
	for k := range r.Headers {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "  %s: %s\n", escapeText(k, false), escapeText(r.Headers[k], false))
	}
	fmt.Fprintf(w, "\npayload (%d bytes):\n", len(r.Payload))
	var pretty bytes.Buffer
	if json.Valid(r.Payload) && json.Indent(&pretty, r.Payload, "  ", "  ") == nil {
		fmt.Fprintf(w, "  %s\n", escapeText(pretty.String(), true))
	} else {
		fmt.Fprintf(w, "  %s\n", escapeText(string(r.Payload), false))
	}
}

func pruneFlags(target pgretention.Target) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		// Flag defaults are the configured retention; a bad configuration
		// is reported when the command runs, not while printing help.
		cfg, _ := app.ConfigFromEnv()
		o := pgretention.Options{BatchSize: cfg.Retention.BatchSize}
		switch target {
		case pgretention.Outbox:
			o.OlderThan, o.Archive = cfg.Retention.Outbox, cfg.Retention.ArchiveOutbox
			fs.BoolVar(&o.Archive, "archive", o.Archive, "move the rows to outbox_archive instead of deleting them")
		case pgretention.ToolCalls:
			o.OlderThan = cfg.Retention.ToolCalls
		default:
			o.OlderThan = cfg.Retention.Ledger
		}
		fs.DurationVar(&o.OlderThan, "older-than", o.OlderThan, "retention")
		fs.IntVar(&o.BatchSize, "batch-size", o.BatchSize, "rows per transaction")
		fs.BoolVar(&o.DryRun, "dry-run", false, "count, delete nothing")
		asJSON := fs.Bool("json", false, "print JSON")
		return func(ctx context.Context, _ []string) error {
			if _, err := LoadConfig(); err != nil {
				return err
			}
			if o.OlderThan <= 0 || o.BatchSize <= 0 {
				return usagef("--older-than and --batch-size must be positive")
			}
			if target == pgretention.Ledger && o.OlderThan < time.Hour {
				return usagef("--older-than must be at least 1h for the ledger: it must outlast redeliveries")
			}
			pool, err := OpenPool(ctx, "prune")
			if err != nil {
				return err
			}
			defer pool.Close()
			res, err := pgretention.Prune(ctx, pool, target, o)
			if err != nil {
				return err
			}
			if *asJSON {
				return WriteJSON(env.Stdout, res)
			}
			verb := map[[2]bool]string{{false, false}: "removed", {false, true}: "archived",
				{true, false}: "would remove", {true, true}: "would archive"}[[2]bool{res.DryRun, res.Archive}]
			fmt.Fprintf(env.Stdout, "%s: %s %d row(s) older than %s (%s) in %d batch(es)\n", res.Target, verb, res.Removed, o.OlderThan, res.Cutoff.Format(time.RFC3339), res.Batches)
			return nil
		}
	}
}

func mcpFlags(fs *flag.FlagSet, env *Env) RunFunc {
	migrate := fs.Bool("migrate", false, "apply pending migrations at start instead of refusing to start")
	return func(ctx context.Context, _ []string) error {
		// stdout is the protocol's: every log line goes to stderr. The tools
		// only write intents, so no broker connection.
		a, logger, err := env.newApp(ctx, *migrate, env.Stderr, true, nil)
		if err != nil {
			return err
		}
		defer a.Close()
		if a.Tools() == nil {
			return errors.New("this application defines no agent tools (app.Options.Tools)")
		}
		logger.Info(env.Name+" mcp serving on stdio", "tools", len(a.Tools().Tools()))
		return mcptools.ServeStdio(ctx, a.Tools(), &mcp.Implementation{Name: env.Name, Version: env.Options.Version}, logger)
	}
}

func shadowReportFlags(fs *flag.FlagSet, env *Env) RunFunc {
	since := fs.Duration("since", 168*time.Hour, "how far back to compare")
	topic := fs.String("topic", "", "only this topic")
	asJSON := fs.Bool("json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		if *since <= 0 {
			return usagef("--since must be positive")
		}
		cfg, pool, err := openMigrated(ctx, "shadow")
		if err != nil {
			return err
		}
		defer pool.Close()
		rep, err := shadow.Report(ctx, pool, shadow.Options{Since: *since, Topic: *topic, ShadowTopics: cfg.Relay.ShadowTopics, OutboxTable: cfg.Relay.Table})
		if err != nil {
			return err
		}
		if *asJSON {
			err = WriteJSON(env.Stdout, map[string]any{"since": rep.Since, "topics": rep.Topics, "agree": rep.Agree()})
		} else {
			err = printShadow(env.Stdout, rep)
		}
		if err != nil {
			return err
		}
		if !rep.Agree() {
			return ExitError{Code: 1, Err: errors.New("the intents and the legacy effects do not agree: do not switch over yet")}
		}
		return nil
	}
}

func printShadow(w io.Writer, rep shadow.ReportResult) error {
	fmt.Fprintf(w, "shadow report since %s\n", rep.Since.Format(time.RFC3339))
	if len(rep.Topics) == 0 {
		fmt.Fprintln(w, "(no shadow intents and no legacy effects in the window)")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tINTENTS\tLEGACY\tMATCHED\tMISSING IN OUTBOX\tMISSING IN LEGACY\tVERDICT")
	for _, t := range rep.Topics {
		verdict := "agree"
		if !t.Agree() {
			verdict = "MISMATCH"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\n", cell(t.Topic, maxIDCell), t.Intents, t.LegacyEffects, t.Matched,
			t.MissingInOutboxCount, t.MissingInLegacyCount, verdict)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, t := range rep.Topics {
		if len(t.MissingInOutbox) > 0 {
			fmt.Fprintf(w, "%s: legacy effect, no intent (sample): %s\n", cell(t.Topic, maxIDCell), sample(t.MissingInOutbox))
		}
		if len(t.MissingInLegacy) > 0 {
			fmt.Fprintf(w, "%s: intent, no legacy effect (sample): %s\n", cell(t.Topic, maxIDCell), sample(t.MissingInLegacy))
		}
	}
	return nil
}

func sample(ids []string) string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = cell(id, maxIDCell)
	}
	return strings.Join(out, ", ")
}

func backfillFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o backfill.Options
	var queryFile string
	var asJSON bool
	fs.StringVar(&o.Name, "name", "", "identifies the backfill, for dedup and resume (required)")
	fs.StringVar(&o.Topic, "topic", "", "the intents' topic (required)")
	fs.StringVar(&o.Query, "query", "", "SQL returning aggregate_id, payload [, headers]")
	fs.StringVar(&queryFile, "query-file", "", "file holding the query")
	fs.BoolVar(&o.Apply, "apply", false, "write the intents (default: a dry run that writes nothing)")
	fs.IntVar(&o.Max, "max", backfill.DefaultMax, "refuse when the query returns more rows")
	fs.DurationVar(&o.Spread, "spread", 0, "spread the intents' available_at evenly over this window from now (e.g. 30m)")
	fs.Float64Var(&o.Rate, "rate", 0, "or schedule this many intents per second")
	fs.BoolVar(&asJSON, "json", false, "print a JSON summary")
	return func(ctx context.Context, _ []string) error {
		if queryFile != "" {
			if o.Query != "" {
				return usagef("give --query or --query-file, not both")
			}
			b, err := os.ReadFile(queryFile)
			if err != nil {
				return usagef("--query-file: %v", err)
			}
			o.Query = string(b)
		}
		if o.Max <= 0 {
			return usagef("--max must be positive")
		}
		if o.Name == "" || o.Topic == "" || strings.TrimSpace(o.Query) == "" {
			return usagef("--name, --topic and --query (or --query-file) are required")
		}
		if o.Spread < 0 || o.Rate < 0 || (o.Spread > 0 && o.Rate > 0) {
			return usagef("give a positive --spread or --rate, not both")
		}
		pool, err := OpenPool(ctx, "backfill")
		if err != nil {
			return err
		}
		defer pool.Close()
		outbox, err := pgoutbox.New(pgoutbox.Config{}, nil)
		if err != nil {
			return err
		}
		if f, ok := env.Stderr.(*os.File); ok && isTerminal(f) && o.Apply {
			o.Progress = func(p backfill.Progress) {
				rate := float64(p.Written) / max(p.Elapsed.Seconds(), 0.001)
				eta := time.Duration(float64(p.ToWrite-p.Written) / max(rate, 0.001) * float64(time.Second))
				fmt.Fprintf(f, "\r%d/%d intents written, %.0f/s, ETA %s   ", p.Written, p.ToWrite, rate, eta.Round(time.Second))
			}
		}
		sum, err := backfill.Run(ctx, pool, outbox, o)
		if o.Progress != nil {
			fmt.Fprintln(env.Stderr)
		}
		if err != nil {
			if errors.Is(err, backfill.ErrTooMany) {
				return usagef("%v", err)
			}
			return err
		}
		if asJSON {
			return WriteJSON(env.Stdout, sum)
		}
		w := env.Stdout
		verb := "would write"
		if o.Apply {
			verb = "wrote"
		}
		fmt.Fprintf(w, "backfill %q on %s: the query returned %d row(s); %d already written by earlier runs of this name (%d in all)\n",
			sum.Name, sum.Topic, sum.Rows, sum.AlreadyWritten, sum.PreviousRuns)
		if o.Apply {
			fmt.Fprintf(w, "%s %d intent(s) of %d\n", verb, sum.Written, sum.ToWrite)
		} else {
			fmt.Fprintf(w, "%s %d intent(s) (dry run: nothing written; --apply writes)\n", verb, sum.ToWrite)
		}
		if sum.FirstAt != nil {
			fmt.Fprintf(w, "schedule: from %s to %s\n", sum.FirstAt.Format(time.RFC3339), sum.LastAt.Format(time.RFC3339))
		}
		for _, s := range sum.Samples {
			b, _ := json.Marshal(s)
			fmt.Fprintf(w, "sample: %s\n", cell(string(b), 500))
		}
		return nil
	}
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func auditFlags(fs *flag.FlagSet, env *Env) RunFunc {
	limit := fs.Int("limit", 50, "the newest this many entries")
	asJSON := fs.Bool("json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		if *limit <= 0 || *limit > 100_000 {
			return usagef("--limit must be in [1, 100000]")
		}
		pool, err := OpenPool(ctx, "audit")
		if err != nil {
			return err
		}
		defer pool.Close()
		entries, err := pgaudit.List(ctx, pool, *limit)
		if err != nil {
			return err
		}
		if *asJSON {
			return WriteJSON(env.Stdout, entries)
		}
		if len(entries) == 0 {
			fmt.Fprintln(env.Stdout, "(no action recorded)")
			return nil
		}
		tw := tabwriter.NewWriter(env.Stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "AT\tWHO\tACTION\tCOUNT\tSCOPE")
		for _, e := range entries {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", e.At.Format(time.RFC3339), cell(e.Actor, maxIDCell), cell(e.Action, maxIDCell), e.Count, cell(e.Scope, maxReasonCell))
		}
		return tw.Flush()
	}
}

func healthcheckFlags(fs *flag.FlagSet, env *Env) RunFunc {
	target := fs.String("url", "", "URL to probe (default http://<FERRY_ADMIN_ADDR>/readyz); credentials in it are used, never printed")
	return func(ctx context.Context, _ []string) error {
		if *target == "" {
			cfg, err := LoadConfig()
			if err != nil {
				return err
			}
			addr := strings.Replace(cfg.AdminAddr, "0.0.0.0", "127.0.0.1", 1)
			*target = "http://" + addr + "/readyz"
		}
		u, err := url.Parse(*target)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return usagef("--url must be an http(s) URL")
		}
		shown := u.Redacted()
		ctx, cancel := context.WithTimeout(ctx, 4*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
		if err != nil {
			return usagef("--url %s: cannot build a request", shown)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err // its text repeats the URL, credentials and all
			}
			return fmt.Errorf("probing %s: %w", shown, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s answered %d: %s", shown, resp.StatusCode, cell(string(body), 300))
		}
		fmt.Fprintf(env.Stdout, "ok: %s\n", cell(string(body), 300))
		return nil
	}
}
