package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
)

func auditFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o Audit
	fs.IntVar(&o.Limit, "limit", 50, "the newest this many entries")
	fs.BoolVar(&o.JSON, "json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		if err := o.validate(); err != nil {
			return err
		}
		pool, err := OpenPool(ctx, "audit")
		if err != nil {
			return err
		}
		defer pool.Close()
		return o.Run(ctx, pool, env.Stdout)
	}
}

// Audit is `audit`: the newest entries of the audit log.
type Audit struct {
	Limit int
	JSON  bool
}

func (o Audit) validate() error {
	if o.Limit <= 0 || o.Limit > 100_000 {
		return usagef("--limit must be in [1, 100000]")
	}
	return nil
}

// Run prints the newest o.Limit entries, newest first.
func (o Audit) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if err := o.validate(); err != nil {
		return err
	}
	entries, err := pgaudit.List(ctx, pool, o.Limit)
	if err != nil {
		return err
	}
	if o.JSON {
		return WriteJSON(w, entries)
	}
	if len(entries) == 0 {
		_, err := fmt.Fprintln(w, "(no action recorded)")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "AT\tWHO\tACTION\tCOUNT\tSCOPE")
	for _, e := range entries {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", e.At.Format(time.RFC3339), cell(e.Actor, maxIDCell), cell(e.Action, maxIDCell), e.Count, cell(e.Scope, maxReasonCell))
	}
	return tw.Flush()
}
