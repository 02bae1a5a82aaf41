package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pgconn"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// openPool connects to the configured database and schema (no broker needed).
func openPool(ctx context.Context, name string) (*pgxpool.Pool, error) {
	cfg, err := loadConfig()
	if err != nil {
		return nil, err
	}
	return pgconn.Open(ctx, pgconn.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-" + name, MaxConns: 2})
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func poison(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return usageError{errors.New("want one of: list, requeue, discard")}
	}
	sub, rest := args[0], args[1:]
	fs := flag.NewFlagSet("poison "+sub, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var (
		sel         pgpoison.Selector
		ids         string
		asJSON, dry bool
		topic       string
		limit       int
	)
	fs.BoolVar(&asJSON, "json", false, "print JSON")
	switch sub {
	case "list":
		fs.StringVar(&topic, "topic", "", "only this original topic")
		fs.IntVar(&limit, "limit", 50, "at most this many (0: all)")
	case "requeue", "discard":
		fs.StringVar(&ids, "id", "", "poison ids, comma-separated")
		fs.StringVar(&sel.Topic, "topic", "", "every message of this original topic")
		fs.BoolVar(&sel.All, "all", false, "every message")
		fs.IntVar(&sel.Limit, "limit", 0, "at most this many, oldest first (0: no cap)")
		fs.BoolVar(&dry, "dry-run", false, "say what would happen, change nothing")
	default:
		return usageError{fmt.Errorf("unknown poison command %q: want list, requeue or discard", sub)}
	}
	if err := fs.Parse(rest); err != nil {
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	for _, p := range splitList(ids) {
		id, err := strconv.ParseInt(p, 10, 64)
		if err != nil || id <= 0 {
			return usageError{fmt.Errorf("--id: %q is not a poison id", p)}
		}
		sel.IDs = append(sel.IDs, id)
	}
	if sub != "list" {
		// Refuse a bad selection before connecting, let alone changing anything.
		if err := sel.Validate(); err != nil {
			return usageError{err}
		}
	}
	pool, err := openPool(ctx, "poison")
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := pgpoison.NewStore(pool, "")
	if err != nil {
		return err
	}
	switch sub {
	case "list":
		recs, err := store.List(ctx, topic, limit)
		if err != nil {
			return err
		}
		if asJSON {
			return writeJSON(stdout, recs)
		}
		printPoison(stdout, recs)
	case "requeue":
		res, err := store.Requeue(ctx, sel, dry)
		if err != nil {
			return err
		}
		if asJSON {
			return writeJSON(stdout, res)
		}
		verb := "requeued"
		if dry {
			verb = "would requeue"
		}
		fmt.Fprintf(stdout, "%s %d message(s) to their original topic\n", verb, len(res.Requeued))
		printPoison(stdout, res.Requeued)
		for _, s := range res.Skipped {
			fmt.Fprintf(stdout, "skipped poison id %d: %s\n", s.Record.ID, s.Why)
		}
	case "discard":
		recs, err := store.Discard(ctx, sel, dry)
		if err != nil {
			return err
		}
		if asJSON {
			return writeJSON(stdout, map[string]any{"discarded": recs, "dry_run": dry})
		}
		verb := "discarded"
		if dry {
			verb = "would discard"
		}
		fmt.Fprintf(stdout, "%s %d message(s)\n", verb, len(recs))
		printPoison(stdout, recs)
	}
	return nil
}

func printPoison(w io.Writer, recs []pgpoison.Record) {
	if len(recs) == 0 {
		fmt.Fprintln(w, "(no poisoned messages)")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTOPIC\tHANDLER\tMESSAGE\tATTEMPTS\tFIRST FAILED\tPOISONED\tREASON")
	for _, r := range recs {
		reason := strings.Join(strings.Fields(r.Reason), " ")
		if len(reason) > 80 {
			reason = reason[:77] + "..."
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s ago\t%s ago\t%s\n", r.ID, r.Topic, r.Handler, r.MessageID, r.Attempts,
			time.Since(r.FirstFailedAt).Round(time.Second), time.Since(r.PoisonedAt).Round(time.Second), reason)
	}
	_ = tw.Flush()
}

func prune(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return usageError{errors.New("want one of: outbox, ledger")}
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	var target pgretention.Target
	o := pgretention.Options{BatchSize: cfg.Retention.BatchSize}
	fs := flag.NewFlagSet("prune "+args[0], flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	switch args[0] {
	case "outbox":
		target, o.OlderThan, o.Archive = pgretention.Outbox, cfg.Retention.Outbox, cfg.Retention.ArchiveOutbox
		fs.BoolVar(&o.Archive, "archive", o.Archive, "move the rows to outbox_archive instead of deleting them")
	case "ledger":
		target, o.OlderThan = pgretention.Ledger, cfg.Retention.Ledger
	default:
		return usageError{fmt.Errorf("unknown prune target %q: want outbox or ledger", args[0])}
	}
	fs.DurationVar(&o.OlderThan, "older-than", o.OlderThan, "retention")
	fs.IntVar(&o.BatchSize, "batch-size", o.BatchSize, "rows per transaction")
	fs.BoolVar(&o.DryRun, "dry-run", false, "count, delete nothing")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := fs.Parse(args[1:]); err != nil {
		return usageError{err}
	}
	if o.OlderThan <= 0 || o.BatchSize <= 0 {
		return usageError{errors.New("--older-than and --batch-size must be positive")}
	}
	if target == pgretention.Ledger && o.OlderThan < time.Hour {
		return usageError{errors.New("--older-than must be at least 1h for the ledger: it must outlast redeliveries")}
	}
	pool, err := openPool(ctx, "prune")
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := pgretention.Prune(ctx, pool, target, o)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, res)
	}
	verb := "removed"
	switch {
	case res.DryRun:
		verb = "would remove"
	case res.Archive:
		verb = "archived"
	}
	fmt.Fprintf(stdout, "%s: %s %d row(s) older than %s (%s) in %d batch(es)\n", res.Target, verb, res.Removed, o.OlderThan, res.Cutoff.Format(time.RFC3339), res.Batches)
	return nil
}

func status(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	asJSON := fs.Bool("json", false, "print JSON")
	threshold := fs.Int("attempts", pgstatus.DefaultAttemptsThreshold, "list rows with more relay attempts than this")
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	pool, err := openPool(ctx, "status")
	if err != nil {
		return err
	}
	defer pool.Close()
	rep, err := pgstatus.Collect(ctx, pool, *threshold)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, rep)
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "outbox: %d pending, oldest due %s\n", rep.PendingTotal, time.Duration(rep.OldestDueAgeS*float64(time.Second)).Round(time.Millisecond))
	if len(rep.Backlog) > 0 {
		fmt.Fprintln(tw, "  TOPIC\tPENDING\tDUE\tDELAYED\tOLDEST DUE\tMAX ATTEMPTS")
		for _, b := range rep.Backlog {
			fmt.Fprintf(tw, "  %s\t%d\t%d\t%d\t%s\t%d\n", b.Topic, b.Pending, b.Due, b.Delayed,
				time.Duration(b.OldestDueAgeS*float64(time.Second)).Round(time.Millisecond), b.MaxAttempts)
		}
	}
	fmt.Fprintf(tw, "rows with more than %d attempts: %d\n", rep.AttemptsThreshold, len(rep.Failing))
	for _, f := range rep.Failing {
		fmt.Fprintf(tw, "  #%d\t%s\t%s\tattempts %d\tnext %s\t%s\n", f.ID, f.Topic, f.AggregateID, f.Attempts,
			f.AvailableAt.Format(time.RFC3339), strings.Join(strings.Fields(f.LastError), " "))
	}
	fmt.Fprintf(tw, "poison store: %d message(s)\n", rep.PoisonTotal)
	for t, n := range rep.Poison {
		fmt.Fprintf(tw, "  %s\t%d\n", t, n)
	}
	fmt.Fprintf(tw, "processes: %d relay(s) and %d consumer(s) alive\n", rep.RelaysAlive, rep.ConsumersAlive)
	for _, in := range rep.Instances {
		state := "alive"
		if !in.Alive {
			state = "DEAD (no heartbeat)"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s pid %d\t%s\tlast heartbeat %s ago\t%s\n", in.ID, in.Components, in.Hostname, in.PID, in.Version,
			rep.At.Sub(in.HeartbeatAt).Round(time.Second), state)
	}
	return tw.Flush()
}

func healthcheck(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("healthcheck", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	url := fs.String("url", "", "URL to probe (default http://<FERRY_ADMIN_ADDR>/readyz)")
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	if *url == "" {
		cfg, err := loadConfig()
		if err != nil {
			return err
		}
		addr := strings.Replace(cfg.AdminAddr, "0.0.0.0", "127.0.0.1", 1)
		*url = "http://" + addr + "/readyz"
	}
	ctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, *url, nil)
	if err != nil {
		return usageError{err}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("probing %s: %w", *url, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s answered %d: %s", *url, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	fmt.Fprintf(stdout, "ok: %s\n", strings.TrimSpace(string(body)))
	return nil
}

func chaos(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var run app.ChaosRun
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	long := fs.Bool("long", false, "the long run: 10,000 orders, broker restarts among the faults")
	fs.IntVar(&run.Orders, "orders", 2000, "orders to place")
	fs.IntVar(&run.Rate, "rate", 200, "create_order calls per second")
	fs.IntVar(&run.Relays, "relays", 2, "ferry relay processes")
	fs.IntVar(&run.Consumers, "consumers", 2, "ferry consume processes")
	seed := fs.Uint64("seed", 1, "seed of the orders and the faults, for replay")
	fs.DurationVar(&run.FaultEvery, "fault-every", 500*time.Millisecond, "pause between injected faults")
	fs.BoolVar(&run.RestartBroker, "restart-broker", false, "also restart RabbitMQ (hits every user of the broker)")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usageError{err}
	}
	run.Seed = *seed
	if *long {
		run.Orders = max(run.Orders, 10_000)
		run.RestartBroker = true
	}
	cfg, logger, err := quietConfig(stderr)
	if err != nil {
		return err
	}
	out := stdout
	if *asJSON {
		out = stderr
	}
	rep, err := app.Chaos(ctx, cfg, run, out, logger)
	if err != nil {
		return err
	}
	if *asJSON {
		if err := writeJSON(stdout, rep); err != nil {
			return err
		}
	}
	if !rep.OK() {
		return fmt.Errorf("%d invariant violation(s): %s", len(rep.Violations), rep.Violations[0])
	}
	return nil
}
