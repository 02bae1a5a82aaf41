package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/internal/attention"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

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
	// AttentionItems are the same, each with its kind, target, count,
	// since and hint, for a script or a pager.
	AttentionItems []attention.Item `json:"attention_items"`
	// Audit is the newest entries of the audit log (ferry audit).
	Audit []pgaudit.Entry `json:"audit"`
	// CDC is the CDC relay's replication slot, when relay mode is cdc or
	// the slot exists.
	CDC *pgcdc.SlotStatus `json:"cdc,omitempty"`
	// Tenants sums up the tenant fleet (FERRY_TENANTS=true): ferry
	// tenants status has the whole table.
	Tenants *tenantsSummary `json:"tenants,omitempty"`
}

// tenantsSummary is the tenant fleet as `ferry status` shows it: how many
// tenants, and those that need a human.
type tenantsSummary struct {
	Count        int            `json:"count"`
	Paused       int            `json:"paused"`
	MembersAlive int            `json:"members_alive"`
	NeedAHuman   []TenantStatus `json:"need_a_human"`
}

func statusFlags(fs *flag.FlagSet, env *Env) RunFunc {
	o := Status{Env: env}
	fs.BoolVar(&o.JSON, "json", false, "print JSON")
	fs.IntVar(&o.Attempts, "attempts", pgstatus.DefaultAttemptsThreshold, "list rows with more relay attempts than this")
	fs.BoolVar(&o.Acknowledge, "acknowledge", false, "record (in the audit log) that the poison store as it is now was seen: its messages stop needing attention and only those poisoned later count toward exit 3")
	fs.BoolVar(&o.ExitCode, "exit-code", true, fmt.Sprintf("exit %d when something needs a human (the broker unreachable, no live relay, a held partition, a queue with messages and no consumer, poisoned, retrying or unrouted messages, rows past --attempts); false: exit 0 whenever the report is printed", ExitAttention))
	return func(ctx context.Context, _ []string) error {
		if o.Attempts < 0 {
			return usagef("--attempts must not be negative")
		}
		cfg, pool, err := openMigrated(ctx, "status")
		if err != nil {
			return err
		}
		defer pool.Close()
		o.Config = cfg
		return o.Run(ctx, pool, env.Stdout)
	}
}

// Status is `status`: the whole report, from the database to the broker to
// the poison store, and what needs a human.
type Status struct {
	// Config is the service's (its broker, CDC slot and routes are read).
	Config app.Config
	// Env gives the application's routes (Options.App), so the broker's
	// queues of each route can be read; nil reads no queue.
	Env *Env
	// Attempts lists rows with more relay attempts than this.
	Attempts int
	// ExitCode makes Run end with ExitAttention when something needs a
	// human.
	ExitCode bool
	JSON     bool
	// Acknowledge records that the poison store as it is now was seen
	// (pgstatus.Acknowledge), before the report is made.
	Acknowledge bool
	// Actor is who acknowledges. Default: the user running the command.
	Actor string
}

// Run collects the report and prints it.
func (o Status) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if o.Attempts < 0 {
		return usagef("--attempts must not be negative")
	}
	env := o.Env
	if env == nil {
		env = &Env{}
	}
	var err error
	if o.Acknowledge {
		if _, err := pgstatus.Acknowledge(ctx, pool, cmp.Or(o.Actor, pgaudit.CLIActor())); err != nil {
			return err
		}
	}
	rep := statusReport{Attention: []string{}}
	if rep.Report, err = pgstatus.Collect(ctx, pool, o.Config.Relay.Table, o.Attempts); err != nil {
		return err
	}
	if err := inspectBroker(ctx, o.Config, env, &rep); err != nil {
		rep.BrokerError = pipeline.CleanText(err.Error(), 300)
	}
	if rep.CDC, err = cdcSlot(ctx, o.Config, pool); err != nil {
		return err
	}
	var tenants []attention.Tenant
	if o.Config.Tenants {
		if rep.Tenants, err = summarizeTenants(ctx, o.Config, pool); err != nil {
			return err
		}
		for _, t := range rep.Tenants.NeedAHuman {
			tenants = append(tenants, attention.Tenant{ID: t.ID, Needs: t.Attention})
		}
	}
	rep.AttentionItems = attention.Items(attention.State{Report: rep.Report, BrokerError: rep.BrokerError, Unrouted: rep.Unrouted,
		Queues: rep.Queues, CDC: rep.CDC, Command: binaryName, Tenants: tenants,
		OutboxRetention: o.Config.Retention.Outbox, LedgerRetention: o.Config.Retention.Ledger, PruneInterval: o.Config.Retention.Interval})
	for _, it := range rep.AttentionItems {
		rep.Attention = append(rep.Attention, it.Text)
	}
	if rep.Audit, err = pgaudit.List(ctx, pool, 20); err != nil {
		return err
	}
	if o.JSON {
		err = WriteJSON(w, rep)
	} else {
		err = printStatus(w, rep)
	}
	if err != nil {
		return err
	}
	if o.ExitCode && len(rep.Attention) > 0 {
		return ExitError{Code: ExitAttention}
	}
	return nil
}

// summarizeTenants reads every tenant's status (ferry tenants status) and
// keeps those that need a human.
func summarizeTenants(ctx context.Context, cfg app.Config, pool *pgxpool.Pool) (*tenantsSummary, error) {
	ts, err := pgtenants.List(ctx, pool)
	if err != nil {
		return nil, err
	}
	all, members, err := collectTenants(ctx, cfg, pool, ts)
	if err != nil {
		return nil, err
	}
	sum := &tenantsSummary{Count: len(all), MembersAlive: len(members), NeedAHuman: []TenantStatus{}}
	for _, t := range all {
		if t.Paused {
			sum.Paused++
		}
		if len(t.Attention) > 0 {
			t.DatabaseURL = pgdb.Redact(t.DatabaseURL)
			sum.NeedAHuman = append(sum.NeedAHuman, t)
		}
	}
	return sum, nil
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
	for _, t := range []struct {
		name  string
		parts []pgweeks.Partition
	}{{"outbox", rep.OutboxPartitions}, {"ledger", rep.LedgerPartitions}} {
		if len(t.parts) == 0 {
			continue
		}
		holding, current := 0, ""
		for _, p := range t.parts {
			if !p.Empty {
				holding++
			}
			if p.Current {
				current = fmt.Sprintf("%s (since %s)", p.Name, p.From.UTC().Format(time.DateOnly))
			}
		}
		fmt.Fprintf(tw, "%s partitions: %d of %d hold rows, current %s\n", t.name, holding, len(t.parts), current)
	}
	fmt.Fprintf(tw, "failing rows (the relay tried and could not publish): %d; tried more than %d times: %d\n", rep.FailingCount, rep.AttemptsThreshold, len(rep.Failing))
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
	if ack := rep.PoisonAcknowledged; ack != nil {
		fmt.Fprintf(tw, "poison store: %d message(s), %d new since %s acknowledged it at %s\n", rep.PoisonTotal, rep.PoisonNew, cell(ack.By, maxIDCell), ack.At.UTC().Format(time.RFC3339))
	} else {
		fmt.Fprintf(tw, "poison store: %d message(s)\n", rep.PoisonTotal)
	}
	topics := make([]string, 0, len(rep.Poison))
	for t := range rep.Poison {
		topics = append(topics, t)
	}
	sort.Strings(topics)
	for _, t := range topics {
		fmt.Fprintf(tw, "  %s\t%d\n", cell(t, maxIDCell), rep.Poison[t])
	}
	if len(rep.Versions) > 0 {
		fmt.Fprintln(tw, "events still to be read, by schema version:")
		fmt.Fprintln(tw, "  TOPIC\tVERSION\tWHERE\tCOUNT\tOLDEST")
		for _, v := range rep.Versions {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%s\n", cell(v.Topic, maxIDCell), cell(cmp.Or(v.Version, "(none)"), maxIDCell), v.Place, v.Count, v.Oldest.UTC().Format(time.RFC3339))
		}
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
	if t := rep.Tenants; t != nil {
		fmt.Fprintf(tw, "tenants: %d (%d paused), %d fleet member(s) alive, %d need a human (%s tenants status)\n", t.Count, t.Paused, t.MembersAlive, len(t.NeedAHuman), binaryName)
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
