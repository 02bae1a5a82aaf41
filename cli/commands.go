package cli

import (
	"context"
	"encoding/json"
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
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

var (
	cmdRun = &Command{Name: "run", Summary: "run the relay, the consumers, the HTTP API (if the application has one) and the hourly pruning in one process",
		Flags: serveFlags(app.All)}
	cmdRelay = &Command{Name: "relay", Summary: "run only the outbox relay (run several for throughput and failover)",
		Flags: serveFlags(app.Components{Relay: true})}
	cmdConsume = &Command{Name: "consume", Summary: "run only the consumers (every handler of the route table)",
		Flags: serveFlags(app.Components{Consumers: true})}
	cmdMigrate = &Command{Name: "migrate", Summary: "apply, roll back or list database migrations (Ferry's, then the application's)", Sub: []*Command{
		{Name: "up", Summary: "apply every pending migration", Flags: migrateFlags("up")},
		{Name: "down", Summary: "roll back the newest applied migration (of the application's sets first)", Flags: migrateFlags("down")},
		{Name: "status", Summary: "list migrations and whether each is applied", Flags: migrateFlags("status")},
	}}
	cmdStatus = &Command{Name: "status", Summary: "pending per topic, oldest pending, rows failing with their last error, poison store depth, relay/consumer liveness",
		Flags: statusFlags}
	cmdPoison = &Command{Name: "poison", Summary: "inspect and act on the poison store", Sub: []*Command{
		{Name: "list", Summary: "what is in the poison store, why, since when", Flags: poisonFlags("list")},
		{Name: "requeue", Summary: "send poisoned messages back to their original topic (attempts reset), atomically: an interrupted requeue loses and doubles nothing",
			Flags: poisonFlags("requeue")},
		{Name: "discard", Summary: "delete poisoned messages", Flags: poisonFlags("discard")},
	}}
	cmdPrune = &Command{Name: "prune", Summary: "remove rows past their retention", Sub: []*Command{
		{Name: "outbox", Summary: "remove (or archive) dispatched outbox rows past their retention", Flags: pruneFlags(pgretention.Outbox)},
		{Name: "ledger", Summary: "remove consumer ledger rows past their retention", Flags: pruneFlags(pgretention.Ledger)},
	}}
	cmdHealthcheck = &Command{Name: "healthcheck", Summary: "exit 0 if the admin server's /readyz (or --url) answers 200; for container healthchecks, the image having no shell or curl",
		Flags: healthcheckFlags}
)

func serveFlags(what app.Components) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		migrate := fs.Bool("migrate", false, "apply pending migrations at start instead of refusing to start")
		return func(ctx context.Context, _ []string) error {
			cfg, err := LoadConfig()
			if err != nil {
				return err
			}
			logger, err := app.NewLogger(cfg, nil)
			if err != nil {
				return err
			}
			opts, err := env.appOptions()
			if err != nil {
				return err
			}
			opts.Migrate = opts.Migrate || *migrate
			opts.Logger, opts.Version = logger, env.Options.Version
			a, err := app.New(ctx, cfg, opts)
			if err != nil {
				return err
			}
			defer a.Close()
			logger.Info(env.Name+" started", "components", what, "version", env.Options.Version)
			return a.Run(ctx, what, nil)
		}
	}
}

// OpenPool connects to the configured database and schema (no broker needed).
func OpenPool(ctx context.Context, name string) (*pgxpool.Pool, error) {
	cfg, err := LoadConfig()
	if err != nil {
		return nil, err
	}
	return pgconn.Open(ctx, pgconn.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-" + name, MaxConns: 2})
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
			pool, err := pgconn.Open(ctx, pgconn.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-migrate"})
			if err != nil {
				return err
			}
			defer pool.Close()
			db := pgconn.SQLDB(pool)
			defer db.Close()
			switch verb {
			case "up":
				if cfg.DatabaseSchema != "" {
					if err := pgconn.EnsureSchema(ctx, pool, cfg.DatabaseSchema); err != nil {
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

func statusFlags(fs *flag.FlagSet, env *Env) RunFunc {
	asJSON := fs.Bool("json", false, "print JSON")
	threshold := fs.Int("attempts", pgstatus.DefaultAttemptsThreshold, "list rows with more relay attempts than this")
	return func(ctx context.Context, _ []string) error {
		pool, err := OpenPool(ctx, "status")
		if err != nil {
			return err
		}
		defer pool.Close()
		rep, err := pgstatus.Collect(ctx, pool, pgoutbox.DefaultTable, *threshold)
		if err != nil {
			return err
		}
		if *asJSON {
			return WriteJSON(env.Stdout, rep)
		}
		return printStatus(env.Stdout, rep)
	}
}

func printStatus(w io.Writer, rep pgstatus.Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
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

func poisonFlags(sub string) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		var (
			sel         pgpoison.Selector
			ids         string
			asJSON, dry bool
			topic       string
			limit       int
		)
		fs.BoolVar(&asJSON, "json", false, "print JSON")
		if sub == "list" {
			fs.StringVar(&topic, "topic", "", "only this original topic")
			fs.IntVar(&limit, "limit", 50, "at most this many (0: all)")
		} else {
			fs.StringVar(&ids, "id", "", "poison ids, comma-separated")
			fs.StringVar(&sel.Topic, "topic", "", "every message of this original topic")
			fs.BoolVar(&sel.All, "all", false, "every message")
			fs.IntVar(&sel.Limit, "limit", 0, "at most this many, oldest first (0: no cap)")
			fs.BoolVar(&dry, "dry-run", false, "say what would happen, change nothing")
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
			if sub != "list" {
				// Refuse a bad selection before connecting, let alone changing anything.
				if err := sel.Validate(); err != nil {
					return UsageError{err}
				}
			}
			pool, err := OpenPool(ctx, "poison")
			if err != nil {
				return err
			}
			defer pool.Close()
			outbox, err := pgoutbox.New(pgoutbox.SchemaAdapter{}, nil)
			if err != nil {
				return err
			}
			store, err := pgpoison.NewStore(pool, outbox)
			if err != nil {
				return err
			}
			out := env.Stdout
			switch sub {
			case "list":
				recs, err := store.List(ctx, topic, limit)
				if err != nil {
					return err
				}
				if asJSON {
					return WriteJSON(out, recs)
				}
				printPoison(out, recs)
			case "requeue":
				res, err := store.Requeue(ctx, sel, dry)
				if err != nil {
					return err
				}
				if asJSON {
					return WriteJSON(out, res)
				}
				verb := "requeued"
				if dry {
					verb = "would requeue"
				}
				fmt.Fprintf(out, "%s %d message(s) to their original topic\n", verb, len(res.Requeued))
				printPoison(out, res.Requeued)
				for _, s := range res.Skipped {
					fmt.Fprintf(out, "skipped poison id %d: %s\n", s.Record.ID, s.Why)
				}
			case "discard":
				recs, err := store.Discard(ctx, sel, dry)
				if err != nil {
					return err
				}
				if asJSON {
					return WriteJSON(out, map[string]any{"discarded": recs, "dry_run": dry})
				}
				verb := "discarded"
				if dry {
					verb = "would discard"
				}
				fmt.Fprintf(out, "%s %d message(s)\n", verb, len(recs))
				printPoison(out, recs)
			}
			return nil
		}
	}
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

func pruneFlags(target pgretention.Target) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		// Flag defaults are the configured retention; a bad configuration
		// is reported when the command runs, not while printing help.
		cfg, _ := app.ConfigFromEnv()
		o := pgretention.Options{BatchSize: cfg.Retention.BatchSize}
		if target == pgretention.Outbox {
			o.OlderThan, o.Archive = cfg.Retention.Outbox, cfg.Retention.ArchiveOutbox
			fs.BoolVar(&o.Archive, "archive", o.Archive, "move the rows to outbox_archive instead of deleting them")
		} else {
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
			verb := "removed"
			switch {
			case res.DryRun:
				verb = "would remove"
			case res.Archive:
				verb = "archived"
			}
			fmt.Fprintf(env.Stdout, "%s: %s %d row(s) older than %s (%s) in %d batch(es)\n", res.Target, verb, res.Removed, o.OlderThan, res.Cutoff.Format(time.RFC3339), res.Batches)
			return nil
		}
	}
}

func healthcheckFlags(fs *flag.FlagSet, env *Env) RunFunc {
	url := fs.String("url", "", "URL to probe (default http://<FERRY_ADMIN_ADDR>/readyz)")
	return func(ctx context.Context, _ []string) error {
		if *url == "" {
			cfg, err := LoadConfig()
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
			return UsageError{err}
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
		fmt.Fprintf(env.Stdout, "ok: %s\n", strings.TrimSpace(string(body)))
		return nil
	}
}
