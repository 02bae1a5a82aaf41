package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/adoption/backfill"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

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
		if env.Options.App != nil {
			// The topic's event type, if the application has one: the
			// intents get its current version and must decode through it.
			opts, err := env.Options.App()
			if err != nil {
				return err
			}
			for _, e := range opts.Events {
				if e.Name() == o.Topic {
					o.Event = e
				}
			}
		}
		cfg, pool, err := openMigrated(ctx, "backfill")
		if err != nil {
			return err
		}
		defer pool.Close()
		b := Backfill{Options: o, JSON: asJSON, Outbox: outboxConfig(cfg)}
		if f, ok := env.Stderr.(*os.File); ok && isTerminal(f) {
			b.Progress = f
		}
		return b.Run(ctx, pool, env.Stdout)
	}
}

// Backfill is `backfill`: intents for rows the legacy system never
// handled, a dry run unless Options.Apply.
type Backfill struct {
	Options backfill.Options
	JSON    bool
	// Progress, if set, gets a progress line as intents are written.
	Progress io.Writer
	// Outbox is where the intents go (the configured outbox table).
	Outbox pgoutbox.Config
}

// Run backfills (or, dry, counts) and prints the summary.
func (o Backfill) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	opts := o.Options
	outbox, err := pgoutbox.New(o.Outbox, nil)
	if err != nil {
		return err
	}
	if o.Progress != nil && opts.Apply {
		opts.Progress = func(p backfill.Progress) {
			rate := float64(p.Written) / max(p.Elapsed.Seconds(), 0.001)
			eta := time.Duration(float64(p.ToWrite-p.Written) / max(rate, 0.001) * float64(time.Second))
			fmt.Fprintf(o.Progress, "\r%d/%d intents written, %.0f/s, ETA %s   ", p.Written, p.ToWrite, rate, eta.Round(time.Second))
		}
	}
	sum, err := backfill.Run(ctx, pool, outbox, opts)
	if opts.Progress != nil {
		fmt.Fprintln(o.Progress)
	}
	if err != nil {
		if errors.Is(err, backfill.ErrTooMany) {
			return usagef("%v", err)
		}
		return err
	}
	if o.JSON {
		return WriteJSON(w, sum)
	}
	verb := "would write"
	if opts.Apply {
		verb = "wrote"
	}
	fmt.Fprintf(w, "backfill %q on %s: the query returned %d row(s); %d already written by earlier runs of this name (%d in all)\n",
		sum.Name, sum.Topic, sum.Rows, sum.AlreadyWritten, sum.PreviousRuns)
	if opts.Apply {
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

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
