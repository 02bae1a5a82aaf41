package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgfilter"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

var cmdOutbox = &Command{Name: "outbox", Summary: "inspect and act on pending outbox rows: those the relay keeps failing to publish, and handlers' durable retries", Sub: []*Command{
	{Name: "failing", Summary: "the rows the relay keeps failing to publish, grouped by error fingerprint (as the console's failing page)", Flags: outboxFailingFlags},
	{Name: "retry-now", Summary: "make a group of failing rows or of retries (or rows by id) due at once; audited in the same transaction", Flags: outboxActionFlags("retry-now")},
	{Name: "discard", Summary: "delete a group of failing rows or of retries (or rows by id); audited, with the ids, in the same transaction", Flags: outboxActionFlags("discard")},
}}

// OutboxFailing is `outbox failing`: the groups of failing rows.
type OutboxFailing struct {
	Filter pgfilter.Filter
	Limit  int
	JSON   bool
}

// Run prints the groups ops reads.
func (o OutboxFailing) Run(ctx context.Context, ops *pgoutbox.Operator, w io.Writer) error {
	groups, err := ops.FailingGroups(ctx, o.Filter, o.Limit)
	if err != nil {
		return err
	}
	if o.JSON {
		if groups == nil {
			groups = []pgoutbox.FailingGroup{}
		}
		return json.NewEncoder(w).Encode(groups)
	}
	if len(groups) == 0 {
		_, err := fmt.Fprintln(w, "no failing outbox rows")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNT\tFINGERPRINT\tTOPICS\tMAX ATTEMPTS\tNEXT TRY\tEXAMPLE")
	for _, g := range groups {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\t%s\n", g.Count, cell(g.Fingerprint, maxIDCell), cell(g.Topics, maxTextCell), g.MaxAttempts,
			g.NextTry.Format("2006-01-02T15:04:05Z07:00"), cell(g.Example, maxTextCell))
	}
	return tw.Flush()
}

func outboxFailingFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o OutboxFailing
	var filter string
	fs.StringVar(&filter, "filter", "", "narrow by topic=T,aggregate=A,text=T,fingerprint=F,correlation=C,message=M,tenant=ID,since=24h|RFC3339,until=… (comma-separated)")
	fs.IntVar(&o.Limit, "limit", 100, "at most this many groups, largest first")
	fs.BoolVar(&o.JSON, "json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		if filter != "" {
			f, err := ParseFilter(filter)
			if err != nil {
				return UsageError{fmt.Errorf("--filter: %w", err)}
			}
			o.Filter = f
		}
		if o.Limit < 1 {
			return usagef("--limit must be at least 1")
		}
		ops, done, err := openOperator(ctx)
		if err != nil {
			return err
		}
		defer done()
		return o.Run(ctx, ops, env.Stdout)
	}
}

// OutboxAction is `outbox retry-now` and `outbox discard`: the same library
// call the console's buttons make (pgoutbox.Operator), so the two cannot
// disagree about which rows a group holds.
type OutboxAction struct {
	// Action is "retry-now" or "discard".
	Action string
	Stuck  pgoutbox.Stuck
	// DryRun counts what the action would touch and changes nothing.
	DryRun bool
	// Max refuses, before acting, a selection that holds more rows: a
	// mistyped group does not discard a whole outage's rows at once.
	// 0: no cap.
	Max   int
	Actor string
	JSON  bool
}

// ErrTooMany is returned when a selection holds more rows than Max.
var ErrTooMany = errors.New("the selection holds more rows than --max allows")

// Run acts (or, dry, counts) and prints what it did.
func (o OutboxAction) Run(ctx context.Context, ops *pgoutbox.Operator, w io.Writer) error {
	n, err := ops.Count(ctx, o.Stuck)
	if err != nil {
		return err
	}
	if o.Max > 0 && n > o.Max {
		return fmt.Errorf("%w: %s holds %d row(s), --max is %d (raise --max or narrow the selection)", ErrTooMany, o.Stuck, n, o.Max)
	}
	if o.DryRun {
		if o.JSON {
			return json.NewEncoder(w).Encode(map[string]any{"dry_run": true, "action": o.Action, "scope": o.Stuck.String(), "count": n})
		}
		_, err := fmt.Fprintf(w, "would %s %d row(s): %s\n", o.Action, n, o.Stuck)
		return err
	}
	do := ops.RetryNow
	if o.Action == "discard" {
		do = ops.Discard
	}
	acted, err := do(ctx, o.Stuck, pgoutbox.By{Actor: o.Actor})
	if err != nil {
		return err
	}
	if acted.IDs == nil {
		acted.IDs = []int64{}
	}
	if o.JSON {
		return json.NewEncoder(w).Encode(map[string]any{"action": o.Action, "scope": o.Stuck.String(), "counted": n, "ids": acted.IDs})
	}
	fmt.Fprintf(w, "%s: %d row(s) of %s\n", o.Action, len(acted.IDs), o.Stuck)
	if len(acted.IDs) != n {
		// The rows changed between the count and the action (the relay
		// published some, new ones failed): say so rather than hide it.
		fmt.Fprintf(w, "note: %d row(s) were counted a moment before; the action took the rows the selection held when it ran\n", n)
	}
	return nil
}

func outboxActionFlags(action string) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		o := OutboxAction{Action: action}
		var kind, ids string
		fs.StringVar(&kind, "kind", "", "failing (rows the relay cannot publish) or retrying (handlers' durable retries); required")
		fs.StringVar(&o.Stuck.Fingerprint, "fingerprint", "", "the group's error fingerprint (as outbox failing and status show it)")
		fs.StringVar(&o.Stuck.Handler, "handler", "", "with --kind retrying: the handler whose retries to act on")
		fs.StringVar(&ids, "id", "", "outbox row ids, comma-separated (instead of a group; still only rows of --kind)")
		fs.BoolVar(&o.DryRun, "dry-run", false, "count the rows the action would touch, change nothing")
		fs.IntVar(&o.Max, "max", DefaultActionLimit, "refuse a selection of more rows than this (0: no cap)")
		fs.BoolVar(&o.JSON, "json", false, "print JSON")
		return func(ctx context.Context, _ []string) error {
			o.Stuck.Kind = pgoutbox.PendingKind(kind)
			for _, p := range strings.Split(ids, ",") {
				if p = strings.TrimSpace(p); p == "" {
					continue
				}
				id, err := strconv.ParseInt(p, 10, 64)
				if err != nil || id <= 0 {
					return usagef("--id: %q is not an outbox row id", p)
				}
				o.Stuck.IDs = append(o.Stuck.IDs, id)
			}
			if len(o.Stuck.IDs) > 0 && o.Stuck.Fingerprint != "" {
				return usagef("choose rows with --id or a group with --fingerprint, not both")
			}
			if o.Stuck.Kind == pgoutbox.Retrying && len(o.Stuck.IDs) == 0 && o.Stuck.Handler == "" {
				return usagef("--kind retrying with --fingerprint needs --handler")
			}
			if err := o.Stuck.Validate(); err != nil {
				return UsageError{errors.New(strings.NewReplacer("pgoutbox: the kind", "--kind", "pgoutbox: choose rows by id or a group by its fingerprint", "choose rows with --id or a group with --fingerprint").Replace(err.Error()))}
			}
			if o.Max < 0 {
				return usagef("--max must not be negative")
			}
			o.Actor = pgaudit.CLIActor()
			ops, done, err := openOperator(ctx)
			if err != nil {
				return err
			}
			defer done()
			return o.Run(ctx, ops, env.Stdout)
		}
	}
}

// openOperator opens the operator over the configured outbox table
// (FERRY_OUTBOX_TABLE).
func openOperator(ctx context.Context) (*pgoutbox.Operator, func(), error) {
	cfg, pool, err := openMigrated(ctx, "outbox")
	if err != nil {
		return nil, nil, err
	}
	ops, err := pgoutbox.NewOperator(pool, cfg.Relay.Table)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return ops, pool.Close, nil
}
