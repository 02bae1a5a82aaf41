package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
)

func pauseFlags(fs *flag.FlagSet, env *Env) RunFunc {
	reason := fs.String("reason", "", "why, for the audit log, status and the console")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one route name")
		}
		pool, err := OpenPool(ctx, "pause")
		if err != nil {
			return err
		}
		defer pool.Close()
		return Pause{Route: args[0], Reason: *reason, Actor: pgaudit.CLIActor()}.Run(ctx, pool, env.Stdout)
	}
}

func resumeFlags(fs *flag.FlagSet, env *Env) RunFunc {
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one route name")
		}
		pool, err := OpenPool(ctx, "resume")
		if err != nil {
			return err
		}
		defer pool.Close()
		return Pause{Route: args[0], Resume: true, Actor: pgaudit.CLIActor()}.Run(ctx, pool, env.Stdout)
	}
}

// Pause is `pause ROUTE` and `resume ROUTE`: the library calls the
// console's buttons make (pgpause.Set and Clear, audited).
type Pause struct {
	Route  string
	Reason string
	// Resume resumes instead of pausing.
	Resume bool
	Actor  string
}

// Run pauses or resumes, and says what follows.
func (o Pause) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if o.Resume {
		err := pgpause.Clear(ctx, pool, o.Route, o.Actor)
		if errors.Is(err, pgpause.ErrNotPaused) {
			return fmt.Errorf("%s: %w", o.Route, err)
		}
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "resumed %s: its consumers go on within %s\n", o.Route, middleware.DefaultPausePoll)
		return err
	}
	err := pgpause.Set(ctx, pool, o.Route, o.Actor, o.Reason)
	if errors.Is(err, pgpause.ErrPaused) {
		return fmt.Errorf("%s: %w", o.Route, err)
	}
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "paused %s: within %s its consumers stop starting messages (those in hand finish); its messages wait at the broker, in order, until `resume %s`\n", o.Route, middleware.DefaultPausePoll, o.Route)
	return err
}
