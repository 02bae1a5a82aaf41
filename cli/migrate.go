package cli

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

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
			pool, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-migrate"})
			if err != nil {
				return err
			}
			defer pool.Close()
			return Migrate{Verb: verb, Sets: sets, Schema: cfg.DatabaseSchema, Outbox: cfg.Relay.Table}.Run(ctx, pool, env.Stdout)
		}
	}
}

// Migrate is `migrate up|down|status` over Sets (Ferry's first, then the
// application's), in Schema (created by up when missing).
type Migrate struct {
	Verb   string
	Sets   []migrations.Set
	Schema string
	// Outbox is the configured outbox table (FERRY_OUTBOX_TABLE): up gives
	// a table of another name than the default the operator views the
	// migrations give the default one (pgoutbox.Table.EnsureViews).
	Outbox pgoutbox.Table
}

// Run applies, rolls back (the newest set with something applied: the
// application's tables sit on Ferry's) or lists.
func (o Migrate) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	db := pgdb.SQLDB(pool)
	defer db.Close()
	sets := o.Sets
	switch o.Verb {
	case "up":
		if o.Schema != "" {
			if err := pgdb.EnsureSchema(ctx, pool, o.Schema); err != nil {
				return err
			}
		}
		for _, s := range sets {
			n, err := s.Up(ctx, db)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "%s: applied %d migration(s)\n", s.Name, n)
		}
		if err := o.outboxViews(ctx, pool, w); err != nil {
			return err
		}
	case "down":
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
			fmt.Fprintf(w, "%s: rolled back 1 migration\n", sets[i].Name)
			return nil
		}
		fmt.Fprintln(w, "nothing to roll back")
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
				fmt.Fprintf(w, "%-16s %05d  %-8s %s\n", s.Name, st.Version, mark, st.Name)
			}
		}
	default:
		return usagef("migrate: want up, down or status, got %q", o.Verb)
	}
	return nil
}

// outboxViews creates the operator views of a configured outbox table of
// another name than the default (whose views the migrations create); a
// table not created yet is said, not an error: the service creates it.
func (o Migrate) outboxViews(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if o.Outbox.Name() == pgoutbox.DefaultTable {
		return nil
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, o.Outbox.Quoted()).Scan(&exists); err != nil {
		return err
	}
	if !exists {
		fmt.Fprintf(w, "outbox table %s (FERRY_OUTBOX_TABLE) does not exist: create it, then run migrate up again for its views\n", o.Outbox)
		return nil
	}
	if err := o.Outbox.EnsureViews(ctx, pool); err != nil {
		return err
	}
	fmt.Fprintf(w, "%s: operator views %s\n", o.Outbox, o.Outbox.View(pgoutbox.StatePending))
	return nil
}
