package cli

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/tenancy"
)

// The tenant registry's commands (docs/tenants.md). They work on the
// control database (FERRY_DATABASE_URL and FERRY_DATABASE_SCHEMA), and,
// for add and migrate, on each tenant's database too.

func tenantsListFlags(fs *flag.FlagSet, env *Env) RunFunc {
	asJSON := fs.Bool("json", false, "print JSON")
	return func(ctx context.Context, args []string) error {
		if len(args) != 0 {
			return usagef("tenants list takes no arguments")
		}
		pool, err := OpenPool(ctx, "tenants")
		if err != nil {
			return err
		}
		defer pool.Close()
		ts, err := pgtenants.List(ctx, pool)
		if err != nil {
			return err
		}
		if *asJSON {
			for i := range ts {
				ts[i].DatabaseURL = pgdb.Redact(ts[i].DatabaseURL)
			}
			return WriteJSON(env.Stdout, ts)
		}
		return writeTenants(env.Stdout, ts)
	}
}

func writeTenants(w io.Writer, ts []pgtenants.Tenant) error {
	if len(ts) == 0 {
		_, err := fmt.Fprintln(w, "no tenants registered (add one: ferry tenants add ID --database-url URL)")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tSTATE\tRELAY RATE\tMAX HANDLERS\tWHERE")
	for _, t := range ts {
		state := "served"
		if t.Paused {
			state = "paused by " + t.PausedBy
			if t.Reason != "" {
				state += ": " + t.Reason
			}
		}
		rate, handlers := "-", "-"
		if t.RelayRate > 0 {
			rate = fmt.Sprintf("%g/s", t.RelayRate)
		}
		if t.MaxHandlers > 0 {
			handlers = fmt.Sprint(t.MaxHandlers)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", t.ID, state, rate, handlers, t.Location())
	}
	return tw.Flush()
}

// TenantStatus is one tenant's line of `tenants status`.
type TenantStatus = tenancy.Status

func tenantsStatusFlags(fs *flag.FlagSet, env *Env) RunFunc {
	asJSON := fs.Bool("json", false, "print JSON")
	only := fs.String("tenant", "", "this tenant only")
	exitCode := fs.Bool("exit-code", true, fmt.Sprintf("exit %d when a tenant needs a human (its database out of reach, no fleet member alive, failing rows, poisoned messages, an event due for over %s)", ExitAttention, tenancy.StaleDue))
	return func(ctx context.Context, args []string) error {
		if len(args) != 0 {
			return usagef("tenants status takes no arguments (--tenant ID for one)")
		}
		cfg, pool, ts, err := openTenants(ctx, *only)
		if err != nil {
			return err
		}
		defer pool.Close()
		out, members, err := collectTenants(ctx, cfg, pool, ts)
		if err != nil {
			return err
		}
		attention := 0
		for _, s := range out {
			attention += len(s.Attention)
		}
		if *asJSON {
			for i := range out {
				out[i].DatabaseURL = pgdb.Redact(out[i].DatabaseURL)
			}
			if err := WriteJSON(env.Stdout, out); err != nil {
				return err
			}
		} else {
			tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TENANT\tSERVED BY\tPENDING\tDUE\tOLDEST DUE\tFAILING\tPOISONED\tPARKED\tNEEDS A HUMAN")
			for _, s := range out {
				by := cmp.Or(s.ServedBy, "-")
				if s.Paused {
					by = "paused"
				}
				need := strings.Join(s.Attention, "; ")
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%d\t%d\t%d\t%s\n", s.ID, by, s.Pending, s.Due, time.Duration(s.OldestDueAgeS*float64(time.Second)).Round(time.Second), s.Failing, s.Poisoned, s.Parked, cmp.Or(need, "-"))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(env.Stdout, "%d tenants, %d fleet members alive\n", len(out), len(members))
		}
		if attention > 0 && *exitCode {
			return ExitError{Code: ExitAttention}
		}
		return nil
	}
}

// collectTenants reads the status of each of ts and the fleet's live
// members (tenancy.Statuses).
func collectTenants(ctx context.Context, cfg app.Config, pool *pgxpool.Pool, ts []pgtenants.Tenant) ([]TenantStatus, []string, error) {
	ob, err := pgoutbox.New(outboxConfig(cfg), nil)
	if err != nil {
		return nil, nil, err
	}
	poison, err := pgpoison.NewStore(pool, ob)
	if err != nil {
		return nil, nil, err
	}
	return tenancy.Statuses(ctx, pool, tenancy.StatusConfig{ControlURL: cfg.DatabaseURL, Outbox: cfg.Relay.Table, Poison: poison, Command: binaryName}, ts)
}

func tenantsAddFlags(fs *flag.FlagSet, env *Env) RunFunc {
	url := fs.String("database-url", "", "the tenant's database (postgres://…; ${NAME} is read from the environment of each process, for a password); default: the control database")
	schema := fs.String("schema", "", "the tenant's schema in that database (created by the migrations); default: the database's default search_path")
	rate := fs.Float64("relay-rate", 0, "events a second the fleet relays for this tenant at most; 0: no limit of its own")
	handlers := fs.Int("max-handlers", 0, "this tenant's messages one process handles at once at most; 0: no limit of its own")
	paused := fs.Bool("paused", false, "register it paused: nothing relayed until `tenants resume`")
	noMigrate := fs.Bool("no-migrate", false, "register only: the tenant's schema is migrated already, or by `tenants migrate` later")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one tenant id")
		}
		t := pgtenants.Tenant{ID: args[0], DatabaseURL: *url, Schema: *schema, RelayRate: *rate, MaxHandlers: *handlers, Paused: *paused}
		if t.Paused {
			t.PausedBy = pgaudit.CLIActor()
			t.Reason = "registered paused"
		}
		if err := t.Validate(); err != nil {
			return usagef("%v", err)
		}
		cfg, pool, err := openMigrated(ctx, "tenants")
		if err != nil {
			return err
		}
		defer pool.Close()
		if t.DatabaseURL == "" && (t.Schema == "" || t.Schema == cfg.DatabaseSchema) {
			return usagef("tenant %s would be in the control database's own schema (FERRY_DATABASE_URL, FERRY_DATABASE_SCHEMA), whose outbox the relay serves already: give it a --schema of its own or a --database-url", t.ID)
		}
		if _, err := pgtenants.Get(ctx, pool, t.ID); err == nil {
			return fmt.Errorf("tenant %s: %w", t.ID, pgtenants.ErrExists)
		}
		if !*noMigrate {
			// Migrated before it is registered: the fleet never serves a
			// tenant whose tables are not there yet.
			sets, err := env.migrationSets()
			if err != nil {
				return err
			}
			if err := migrateTenant(ctx, cfg, t, sets, env.Stdout); err != nil {
				return err
			}
		}
		if err := pgtenants.Add(ctx, pool, t, pgaudit.CLIActor()); err != nil {
			return err
		}
		_, err = fmt.Fprintf(env.Stdout, "added tenant %s (%s): the fleet serves it within FERRY_TENANTS_RELOAD (%s by default)\n", t.ID, t.Location(), tenancy.DefaultReload)
		return err
	}
}

func tenantsRemoveFlags(fs *flag.FlagSet, env *Env) RunFunc {
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one tenant id")
		}
		return onTenant(ctx, env, args[0], func(pool *pgxpool.Pool, id string) (string, error) {
			return "removed tenant " + id + ": the fleet stops relaying its outbox at its next reload; its events still at the broker go to the poison store (tenant not in the registry), the rest stay in its outbox; its database is left as it is",
				pgtenants.Remove(ctx, pool, id, pgaudit.CLIActor())
		})
	}
}

func tenantsPauseFlags(fs *flag.FlagSet, env *Env) RunFunc {
	reason := fs.String("reason", "", "why, for the audit log and `tenants list`")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one tenant id")
		}
		return onTenant(ctx, env, args[0], func(pool *pgxpool.Pool, id string) (string, error) {
			return "paused tenant " + id + ": the fleet stops relaying its outbox at its next reload (its events wait there, in order); messages already at the broker are handled",
				pgtenants.Pause(ctx, pool, id, pgaudit.CLIActor(), *reason)
		})
	}
}

func tenantsResumeFlags(fs *flag.FlagSet, env *Env) RunFunc {
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one tenant id")
		}
		return onTenant(ctx, env, args[0], func(pool *pgxpool.Pool, id string) (string, error) {
			return "resumed tenant " + id + ": the fleet relays its outbox again at its next reload", pgtenants.Resume(ctx, pool, id, pgaudit.CLIActor())
		})
	}
}

func tenantsLimitFlags(fs *flag.FlagSet, env *Env) RunFunc {
	rate := fs.Float64("relay-rate", 0, "events a second the fleet relays for this tenant at most; 0 lifts the limit")
	handlers := fs.Int("max-handlers", 0, "this tenant's messages one process handles at once at most; 0 lifts the limit")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one tenant id")
		}
		return onTenant(ctx, env, args[0], func(pool *pgxpool.Pool, id string) (string, error) {
			return fmt.Sprintf("tenant %s: relay rate %s, max handlers %s, from the fleet's next reload", id, limitText(*rate, "/s"), limitText(float64(*handlers), "")),
				pgtenants.Limit(ctx, pool, id, *rate, *handlers, pgaudit.CLIActor())
		})
	}
}

func limitText(v float64, unit string) string {
	if v == 0 {
		return "unlimited"
	}
	return fmt.Sprintf("%g%s", v, unit)
}

func onTenant(ctx context.Context, env *Env, id string, do func(*pgxpool.Pool, string) (string, error)) error {
	if err := pgtenants.ValidateID(id); err != nil {
		return usagef("%v", err)
	}
	pool, err := OpenPool(ctx, "tenants")
	if err != nil {
		return err
	}
	defer pool.Close()
	said, err := do(pool, id)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(env.Stdout, said)
	return err
}

func tenantsMigrateFlags(fs *flag.FlagSet, env *Env) RunFunc {
	only := fs.String("tenant", "", "migrate this tenant only")
	return func(ctx context.Context, args []string) error {
		if len(args) != 0 {
			return usagef("tenants migrate takes no arguments (--tenant ID for one)")
		}
		cfg, pool, ts, err := openTenants(ctx, *only)
		if err != nil {
			return err
		}
		defer pool.Close()
		sets, err := env.migrationSets()
		if err != nil {
			return err
		}
		var failed []string
		for _, t := range ts {
			if err := migrateTenant(ctx, cfg, t, sets, env.Stdout); err != nil {
				fmt.Fprintf(env.Stdout, "%s: FAILED: %v\n", t.ID, err)
				failed = append(failed, t.ID)
			}
		}
		if len(failed) > 0 {
			return fmt.Errorf("migrating %d of %d tenants failed: %s (the others are migrated; run it again once their databases answer)", len(failed), len(ts), strings.Join(failed, ", "))
		}
		return nil
	}
}

// openTenants opens the control database and reads the registry: every
// tenant, or only the one named (not registered: ErrNotFound).
func openTenants(ctx context.Context, only string) (app.Config, *pgxpool.Pool, []pgtenants.Tenant, error) {
	cfg, pool, err := openMigrated(ctx, "tenants")
	if err != nil {
		return cfg, nil, nil, err
	}
	ts, err := pgtenants.List(ctx, pool)
	if err == nil && only != "" {
		ts = slices.DeleteFunc(ts, func(t pgtenants.Tenant) bool { return t.ID != only })
		if len(ts) == 0 {
			err = fmt.Errorf("tenant %s: %w", only, pgtenants.ErrNotFound)
		}
	}
	if err != nil {
		pool.Close()
		return cfg, nil, nil, err
	}
	return cfg, pool, ts, nil
}

// migrateTenant applies sets to tenant t (its schema created if missing)
// and says each set's version there.
func migrateTenant(ctx context.Context, cfg app.Config, t pgtenants.Tenant, sets []migrations.Set, w io.Writer) error {
	pool, err := tenancy.Connect(ctx, cfg.DatabaseURL, t, pgdb.Config{ApplicationName: "ferry-tenants-migrate", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	var out strings.Builder
	if err := (Migrate{Verb: "up", Sets: sets, Schema: t.Schema, Outbox: cfg.Relay.Table}).Run(ctx, pool, &out); err != nil {
		return err
	}
	db := pgdb.SQLDB(pool)
	defer db.Close()
	var versions []string
	for _, s := range sets {
		states, err := s.Status(ctx, db)
		if err != nil {
			return err
		}
		var v int64
		for _, st := range states {
			if st.Applied {
				v = max(v, st.Version)
			}
		}
		versions = append(versions, fmt.Sprintf("%s at %05d", s.Name, v))
	}
	applied := strings.ReplaceAll(strings.TrimSpace(out.String()), "\n", "; ")
	_, err = fmt.Fprintf(w, "%s: %s (%s)\n", t.ID, strings.Join(versions, ", "), applied)
	return err
}
