package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
)

func heldListFlags(fs *flag.FlagSet, env *Env) RunFunc {
	route := fs.String("route", "", "only this route's partitions")
	asJSON := fs.Bool("json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		pool, err := OpenPool(ctx, "held list")
		if err != nil {
			return err
		}
		defer pool.Close()
		return HeldList{Route: *route, JSON: *asJSON}.Run(ctx, pool, env.Stdout)
	}
}

func heldRetryFlags(fs *flag.FlagSet, env *Env) RunFunc {
	route := fs.String("route", "", "every held partition of this route (instead of one PARTITION)")
	asJSON := fs.Bool("json", false, "print JSON")
	return func(ctx context.Context, args []string) error {
		if (*route == "") == (len(args) == 0) || len(args) > 1 {
			return usagef("name one held PARTITION (as `held list` shows it) or --route")
		}
		pool, err := OpenPool(ctx, "held retry-now")
		if err != nil {
			return err
		}
		defer pool.Close()
		o := HeldRetry{Route: *route, JSON: *asJSON, Actor: pgaudit.CLIActor()}
		if len(args) == 1 {
			o.Partition = args[0]
		}
		return o.Run(ctx, pool, env.Stdout)
	}
}

// HeldList is `held list`: the ordered partitions held behind a failing
// head, as the console's overview lists them.
type HeldList struct {
	Route string
	JSON  bool
}

// Run prints the holds.
func (o HeldList) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	all, err := pgheld.List(ctx, pool)
	if err != nil {
		return err
	}
	held := []pgheld.Partition{}
	for _, h := range all {
		if o.Route == "" || h.Route() == o.Route {
			held = append(held, h)
		}
	}
	if o.JSON {
		return WriteJSON(w, held)
	}
	if len(held) == 0 {
		_, err := fmt.Fprintln(w, "(no partition is held)")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PARTITION\tHEAD\tHELD FOR\tNEXT ATTEMPT\tLAST ERROR")
	for _, h := range held {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", cell(h.Consumer, 60), cell(h.MessageID, 40), time.Since(h.Since).Round(time.Second), h.Attempt, cell(h.LastError, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "(retry now: %s held retry-now PARTITION, or --route ROUTE for all of a route's)\n", binaryName)
	return err
}

// HeldRetry is `held retry-now`: the console's Retry now, for one held
// partition or every held partition of a route (pgheld.RetryNow,
// RetryRoute; audited).
type HeldRetry struct {
	Partition, Route string
	JSON             bool
	Actor            string
}

// Run asks the holds to retry now and says which did.
func (o HeldRetry) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	var asked []pgheld.Partition
	if o.Route != "" {
		var err error
		if asked, err = pgheld.RetryRoute(ctx, pool, o.Route, o.Actor, nil); err != nil {
			return err
		}
		if len(asked) == 0 {
			return fmt.Errorf("no partition of %s is held", o.Route)
		}
	} else {
		h, err := pgheld.Head(ctx, pool, o.Partition)
		if errors.Is(err, pgheld.ErrNotHeld) {
			return fmt.Errorf("%s: %w", o.Partition, err)
		}
		if err != nil {
			return err
		}
		if err := pgheld.RetryNow(ctx, pool, h.Consumer, h.MessageID, o.Actor); err != nil {
			return fmt.Errorf("%s: %w", o.Partition, err)
		}
		asked = []pgheld.Partition{h.Partition}
	}
	if o.JSON {
		return WriteJSON(w, asked)
	}
	for _, h := range asked {
		if _, err := fmt.Fprintf(w, "asked %s to try %s again now (its consumer looks every second; the try counts as an attempt)\n", cell(h.Consumer, 200), cell(h.MessageID, 200)); err != nil {
			return err
		}
	}
	return nil
}
