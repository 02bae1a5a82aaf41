package cli

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
)

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
