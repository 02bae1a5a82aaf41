package migrations

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"
)

// VersionTable is goose's bookkeeping table, in the same schema as Ferry's tables.
const VersionTable = "ferry_schema_version"

// Set is one independent series of goose migrations with its own version
// table: Ferry's library tables (Library), or an application's own tables,
// which it migrates with the same commands (app.Options.Migrations: `run
// --migrate` and the CLI's `migrate` commands, which take the options from
// cli.Options.App) without mixing version numbers with Ferry's.
type Set struct {
	// Name identifies the set in messages and `ferry migrate status`.
	Name string
	// FS holds the "NNNNN_name.sql" files at its root: //go:embed *.sql in
	// the package that holds them, or fs.Sub(yours, "migrations") for an
	// embed of migrations/*.sql (Validate names the fix).
	FS fs.FS
	// VersionTable is goose's bookkeeping table of this set; it must differ
	// from every other set's.
	VersionTable string
}

// Library is Ferry's own set: the outbox, ledger, poison store and the rest.
var Library = Set{Name: "ferry", FS: FS, VersionTable: VersionTable}

// Validate reports a set that cannot work.
func (s Set) Validate() error {
	var errs []error
	if s.Name == "" {
		errs = append(errs, errors.New("migration set has no name"))
	}
	if s.FS == nil {
		errs = append(errs, fmt.Errorf("migration set %q has no files", s.Name))
	} else if err := checkFiles(s); err != nil {
		errs = append(errs, err)
	}
	if s.VersionTable == "" {
		errs = append(errs, fmt.Errorf("migration set %q has no version table", s.Name))
	}
	return errors.Join(errs...)
}

// checkFiles finds the set's .sql files at the root of its FS, where goose
// reads them. `//go:embed migrations/*.sql` puts them under migrations/,
// and goose would only say "no migrations found": name the fix instead.
func checkFiles(s Set) error {
	root, err := fs.Glob(s.FS, "*.sql")
	if err != nil {
		return fmt.Errorf("migration set %q: %w", s.Name, err)
	}
	if len(root) > 0 {
		return nil
	}
	var nested []string
	_ = fs.WalkDir(s.FS, ".", func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".sql") && len(nested) < 3 {
			nested = append(nested, path)
		}
		return nil
	})
	if len(nested) > 0 {
		dir := path.Dir(nested[0])
		return fmt.Errorf("migration set %q: the .sql files are in %q, not at the root of FS (found %s); pass fs.Sub(yourFS, %q)",
			s.Name, dir, strings.Join(nested, ", "), dir)
	}
	return fmt.Errorf("migration set %q: FS holds no .sql file (want NNNNN_name.sql files at its root; embed them with //go:embed *.sql in the package that holds them, or pass fs.Sub)", s.Name)
}

func (s Set) provider(db *sql.DB) (*goose.Provider, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, s.FS,
		goose.WithTableName(s.VersionTable),
		goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return nil, fmt.Errorf("loading migrations of %s: %w", s.Name, err)
	}
	return p, nil
}

// Up applies Ferry's pending migrations and returns how many it applied.
func Up(ctx context.Context, db *sql.DB) (int, error) { return Library.Up(ctx, db) }

// Down rolls back Ferry's newest applied migration.
func Down(ctx context.Context, db *sql.DB) error { return Library.Down(ctx, db) }

// Status lists Ferry's migrations and whether each is applied.
func Status(ctx context.Context, db *sql.DB) ([]State, error) { return Library.Status(ctx, db) }

// Pending reports whether one of Ferry's migrations is not applied yet.
func Pending(ctx context.Context, db *sql.DB) (bool, error) { return Library.Pending(ctx, db) }

// Up applies every pending migration of s and returns how many it applied.
func (s Set) Up(ctx context.Context, db *sql.DB) (int, error) {
	p, err := s.provider(db)
	if err != nil {
		return 0, err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return len(res), fmt.Errorf("applying migrations: %w", err)
	}
	return len(res), nil
}

// Down rolls back the newest applied migration of s.
func (s Set) Down(ctx context.Context, db *sql.DB) error {
	p, err := s.provider(db)
	if err != nil {
		return err
	}
	if _, err := p.Down(ctx); err != nil {
		return fmt.Errorf("rolling back migration: %w", err)
	}
	return nil
}

// State is one migration's status.
type State struct {
	Version int64
	Name    string
	Applied bool
}

// Status lists every migration of s and whether it is applied.
func (s Set) Status(ctx context.Context, db *sql.DB) ([]State, error) {
	p, err := s.provider(db)
	if err != nil {
		return nil, err
	}
	exists, err := versionTableExists(ctx, db, s.VersionTable)
	if err != nil {
		return nil, err
	}
	if !exists { // never migrated: everything is pending
		var out []State
		for _, src := range p.ListSources() {
			out = append(out, State{Version: src.Version, Name: src.Path})
		}
		return out, nil
	}
	st, err := p.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("reading migration status: %w", err)
	}
	out := make([]State, len(st))
	for i, s := range st {
		out[i] = State{Version: s.Source.Version, Name: s.Source.Path, Applied: s.State == goose.StateApplied}
	}
	return out, nil
}

// Pending reports whether some migration of s is not applied yet (all of
// them, when the schema has never been migrated).
func (s Set) Pending(ctx context.Context, db *sql.DB) (bool, error) {
	exists, err := versionTableExists(ctx, db, s.VersionTable)
	if err != nil {
		return false, err
	}
	if !exists {
		return true, nil
	}
	p, err := s.provider(db)
	if err != nil {
		return false, err
	}
	pending, err := p.HasPending(ctx)
	if err != nil {
		return false, fmt.Errorf("checking for pending migrations: %w", err)
	}
	return pending, nil
}

func versionTableExists(ctx context.Context, db *sql.DB, table string) (bool, error) {
	var exists bool
	// quote_ident: the version table's name is taken literally, in the
	// connection's search_path, like goose does.
	if err := db.QueryRowContext(ctx, `SELECT to_regclass(quote_ident($1)) IS NOT NULL`, table).Scan(&exists); err != nil {
		return false, fmt.Errorf("looking for the migration table: %w", err)
	}
	return exists, nil
}

// ReadTables are the tables the reading commands (status, poison,
// audit) need: a schema without them was not migrated, or is not the
// service's.
var ReadTables = []string{"outbox", "poison_messages", "processed_messages", "ferry_instances", "ferry_audit_log"}

// MissingTables returns which of tables the connection's search_path does
// not find.
func MissingTables(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, tables []string) ([]string, error) {
	var missing []string
	err := q.QueryRow(ctx, `SELECT coalesce(array_agg(t) FILTER (WHERE to_regclass(quote_ident(t)) IS NULL), '{}')
		FROM unnest($1::text[]) t`, tables).Scan(&missing)
	return missing, err
}
