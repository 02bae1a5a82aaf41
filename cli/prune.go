package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
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
			fs.BoolVar(&o.Archive, "archive", o.Archive, "copy the rows to outbox_archive before their partition is emptied (the legacy partition's are moved row by row)")
		case pgretention.ToolCalls:
			o.OlderThan = cfg.Retention.ToolCalls
		case pgretention.PoisonArchive:
			o.OlderThan = cfg.Retention.PoisonArchive
		default:
			o.OlderThan = cfg.Retention.Ledger
		}
		fs.DurationVar(&o.OlderThan, "older-than", o.OlderThan, "retention")
		fs.IntVar(&o.BatchSize, "batch-size", o.BatchSize, "rows per transaction (of what is pruned row by row)")
		fs.BoolVar(&o.DryRun, "dry-run", false, "count, delete nothing")
		asJSON := fs.Bool("json", false, "print JSON")
		return func(ctx context.Context, _ []string) error {
			cfg, err := LoadConfig()
			if err != nil {
				return err
			}
			o.Table = cfg.Relay.Table
			prune := Prune{Target: target, Options: o, JSON: *asJSON}
			// Refuse bad flags before connecting.
			if err := prune.validate(); err != nil {
				return err
			}
			pool, err := OpenPool(ctx, "prune")
			if err != nil {
				return err
			}
			defer pool.Close()
			return prune.Run(ctx, pool, env.Stdout)
		}
	}
}

// Prune is `prune outbox|ledger|tool-calls|poison-archive`.
type Prune struct {
	Target  pgretention.Target
	Options pgretention.Options
	JSON    bool
}

func (o Prune) validate() error {
	if o.Options.OlderThan <= 0 || o.Options.BatchSize <= 0 {
		return usagef("--older-than and --batch-size must be positive")
	}
	if o.Target == pgretention.Ledger && o.Options.OlderThan < time.Hour {
		return usagef("--older-than must be at least 1h for the ledger: it must outlast redeliveries")
	}
	if o.Target == pgretention.Ledger && o.Options.OlderThan > pgweeks.MaxRetention {
		return usagef("--older-than must be at most %s for the ledger (its %d weekly partitions)", pgweeks.MaxRetention, pgweeks.Slots)
	}
	if o.Target == pgretention.Outbox && o.Options.OlderThan > pgweeks.MaxRetention {
		return usagef("--older-than must be at most %s for the outbox (its %d weekly partitions); archive it to keep rows longer", pgweeks.MaxRetention, pgweeks.Slots)
	}
	return nil
}

// Run checks the options, prunes (or, dry, counts) and prints the result.
func (o Prune) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if err := o.validate(); err != nil {
		return err
	}
	res, err := pgretention.Prune(ctx, pool, o.Target, o.Options)
	if err != nil {
		return err
	}
	if o.JSON {
		return WriteJSON(w, res)
	}
	verb := map[[2]bool]string{{false, false}: "removed", {false, true}: "archived",
		{true, false}: "would remove", {true, true}: "would archive"}[[2]bool{res.DryRun, res.Archive}]
	if _, err := fmt.Fprintf(w, "%s: %s %d row(s) older than %s (%s) in %d batch(es)\n", res.Target, verb, res.Removed, o.Options.OlderThan, res.Cutoff.Format(time.RFC3339), res.Batches); err != nil {
		return err
	}
	if p := res.Partitions; p != nil && len(p.Partitions)+len(p.Waiting) > 0 {
		verb := map[bool]string{false: "emptied", true: "would empty"}[res.DryRun]
		moving := ""
		if o.Target == pgretention.Outbox {
			moving = fmt.Sprintf(", moving %d pending row(s) to the current one first", p.Moved)
		}
		if _, err := fmt.Fprintf(w, "%s: %s %d partition(s) %v whole%s\n", res.Target, verb, len(p.Partitions), p.Partitions, moving); err != nil {
			return err
		}
		for _, wt := range p.Waiting {
			if _, err := fmt.Fprintf(w, "%s: partition waiting: %s\n", res.Target, wt); err != nil {
				return err
			}
		}
	}
	return nil
}
