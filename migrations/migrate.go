package migrations

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/pressly/goose/v3"
)

// VersionTable is goose's bookkeeping table, in the same schema as Ferry's tables.
const VersionTable = "ferry_schema_version"

func provider(db *sql.DB) (*goose.Provider, error) {
	p, err := goose.NewProvider(goose.DialectPostgres, db, FS,
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return nil, fmt.Errorf("loading migrations: %w", err)
	}
	return p, nil
}

// Up applies every pending migration and returns how many it applied.
func Up(ctx context.Context, db *sql.DB) (int, error) {
	p, err := provider(db)
	if err != nil {
		return 0, err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return len(res), fmt.Errorf("applying migrations: %w", err)
	}
	return len(res), nil
}

// Down rolls back the newest applied migration.
func Down(ctx context.Context, db *sql.DB) error {
	p, err := provider(db)
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

// Status lists every migration and whether it is applied.
func Status(ctx context.Context, db *sql.DB) ([]State, error) {
	p, err := provider(db)
	if err != nil {
		return nil, err
	}
	exists, err := versionTableExists(ctx, db)
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

// Pending reports whether some migration is not applied yet (all of them,
// when the schema has never been migrated).
func Pending(ctx context.Context, db *sql.DB) (bool, error) {
	exists, err := versionTableExists(ctx, db)
	if err != nil {
		return false, err
	}
	if !exists {
		return true, nil
	}
	p, err := provider(db)
	if err != nil {
		return false, err
	}
	pending, err := p.HasPending(ctx)
	if err != nil {
		return false, fmt.Errorf("checking for pending migrations: %w", err)
	}
	return pending, nil
}

func versionTableExists(ctx context.Context, db *sql.DB) (bool, error) {
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, VersionTable).Scan(&exists); err != nil {
		return false, fmt.Errorf("looking for the migration table: %w", err)
	}
	return exists, nil
}
