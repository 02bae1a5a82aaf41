package cli

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
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
			return Migrate{Verb: verb, Sets: sets, Schema: cfg.DatabaseSchema}.Run(ctx, pool, env.Stdout)
		}
	}
}

// Migrate is `migrate up|down|status` over Sets (Ferry's first, then the
// application's), in Schema (created by up when missing).
type Migrate struct {
	Verb   string
	Sets   []migrations.Set
	Schema string
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
