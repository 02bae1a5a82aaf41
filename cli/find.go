package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

func findFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o Find
	fs.IntVar(&o.Limit, "limit", 20, "at most this many messages, the newest")
	fs.BoolVar(&o.JSON, "json", false, "print JSON")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one message id, aggregate id or correlation id")
		}
		if o.Limit <= 0 || o.Limit > 1000 {
			return usagef("--limit must be in [1, 1000]")
		}
		o.Query = args[0]
		cfg, pool, err := openMigrated(ctx, "find")
		if err != nil {
			return err
		}
		o.Table = cfg.Relay.Table
		defer pool.Close()
		return o.Run(ctx, pool, env.Stdout)
	}
}

// Find is `find`: the console's "Find a message" (pgstatus.Find).
type Find struct {
	Query string
	// Table is the outbox (FERRY_OUTBOX_TABLE).
	Table pgoutbox.Table
	// Routes are the app's route names (the ledger's keys); empty, the
	// ledger is scanned for the message.
	Routes []string
	Limit  int
	JSON   bool
}

// Run looks the query up and prints, per message, where it is now and
// where it was seen.
func (o Find) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	found, err := pgstatus.Find(ctx, pool, o.Table, o.Routes, o.Query, o.Limit)
	if err != nil {
		return err
	}
	if o.JSON {
		return WriteJSON(w, found)
	}
	for _, s := range found.NotSearched {
		fmt.Fprintf(w, "not searched: %s\n", s)
	}
	if len(found.Trails) == 0 {
		_, err := fmt.Fprintf(w, "nothing found for %s in any store (past retention, or never published)\n", cell(o.Query, 100))
		return err
	}
	for i, tr := range found.Trails {
		if i > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "message %s  topic %s  aggregate %s", cell(tr.MessageID, 80), cell(tr.Topic, 60), cell(tr.AggregateID, 60))
		if tr.TraceID != "" {
			fmt.Fprintf(w, "  trace %s", cell(tr.TraceID, 40))
		}
		fmt.Fprintf(w, "\n  now: %s\n", cell(tr.Now, 400))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, s := range tr.Sightings {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", s.At.UTC().Format(time.RFC3339), s.Store, cell(s.State, 160), cell(s.Error, 120))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if found.Truncated {
		fmt.Fprintf(w, "\n(the newest %d messages; --limit shows more)\n", len(found.Trails))
	}
	return nil
}
