package cli

import (
	"context"
	"flag"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
)

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
