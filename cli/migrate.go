package cli

import (
	"context"
	"flag"
	"fmt"

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
			db := pgdb.SQLDB(pool)
			defer db.Close()
			switch verb {
			case "up":
				if cfg.DatabaseSchema != "" {
					if err := pgdb.EnsureSchema(ctx, pool, cfg.DatabaseSchema); err != nil {
						return err
					}
				}
				for _, s := range sets {
					n, err := s.Up(ctx, db)
					if err != nil {
						return err
					}
					fmt.Fprintf(env.Stdout, "%s: applied %d migration(s)\n", s.Name, n)
				}
			case "down":
				// The application's tables sit on Ferry's: roll back the
				// newest set that has something applied.
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
					fmt.Fprintf(env.Stdout, "%s: rolled back 1 migration\n", sets[i].Name)
					return nil
				}
				fmt.Fprintln(env.Stdout, "nothing to roll back")
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
						fmt.Fprintf(env.Stdout, "%-16s %05d  %-8s %s\n", s.Name, st.Version, mark, st.Name)
					}
				}
			}
			return nil
		}
	}
}
