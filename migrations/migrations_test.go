package migrations_test

import (
	"context"
	"io/fs"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	schema := pipelinetest.Schema(t) // migrated up already
	pool := pipelinetest.Pool(t, schema, "ferry-test-migrations")
	db := pgdb.SQLDB(pool)
	defer db.Close()
	ctx := context.Background()

	pending, err := migrations.Pending(ctx, db)
	require.NoError(t, err)
	require.False(t, pending)
	states, err := migrations.Status(ctx, db)
	require.NoError(t, err)
	require.Len(t, states, ferryMigrations(t))
	for _, s := range states {
		require.True(t, s.Applied, s.Name)
	}

	for range states {
		require.NoError(t, migrations.Down(ctx, db))
	}
	var tables int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename <> $2`, schema, migrations.VersionTable).Scan(&tables))
	require.Zero(t, tables, "down removes every table")

	n, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	require.Equal(t, ferryMigrations(t), n)

	var indexes []string
	rows, err := pool.Query(ctx, `SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND tablename = 'outbox' AND indexdef LIKE '%WHERE%dispatched_at%'`, schema)
	require.NoError(t, err)
	for rows.Next() {
		var d string
		require.NoError(t, rows.Scan(&d))
		indexes = append(indexes, d)
	}
	// The slow lane's (migration 00024): the per-row pending indexes are gone.
	require.Len(t, indexes, 2)
	for _, d := range indexes {
		require.Contains(t, d, "WHERE ((dispatched_at IS NULL) AND (slow OR (tx IS NULL)))")
	}
	// Find's (migration 00032): every key it looks up is indexed, on the
	// partitioned table and its archive, and valid once attached.
	var find, valid int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE i.indisvalid) FROM pg_indexes x
		JOIN pg_class c ON c.relname = x.indexname JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = x.schemaname
		JOIN pg_index i ON i.indexrelid = c.oid
		WHERE x.schemaname = $1 AND x.tablename IN ('outbox', 'outbox_archive')
		  AND (x.indexdef LIKE '%message_uuid%' OR x.indexdef LIKE '%correlation_id%' OR x.indexdef LIKE '%ferry_message_id%')`, schema).Scan(&find, &valid))
	require.Equal(t, 6, find, "three on the outbox, three on its archive")
	require.Equal(t, find, valid)
}

func TestStatusOfAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Pool(t, pipelinetest.UniqueName("ferry_never_migrated_"), "ferry-test-migrations")
	db := pgdb.SQLDB(pool)
	defer db.Close()
	states, err := migrations.Status(context.Background(), db)
	require.NoError(t, err)
	require.Len(t, states, ferryMigrations(t))
	for _, s := range states {
		require.False(t, s.Applied)
	}
	pending, err := migrations.Pending(context.Background(), db)
	require.NoError(t, err)
	require.True(t, pending)
}

// A set embedded as `//go:embed migrations/*.sql` keeps its files under
// migrations/: Validate names the fix (fs.Sub) instead of goose's bare "no
// migrations found".
func TestSetNamesTheFixForFilesBelowTheRoot(t *testing.T) {
	nested := fstest.MapFS{"migrations/00001_a.sql": {Data: []byte("-- +goose Up\nSELECT 1;\n")}}
	err := migrations.Set{Name: "app", FS: nested, VersionTable: "app_version"}.Validate()
	require.ErrorContains(t, err, `pass fs.Sub(yourFS, "migrations")`)
	sub, err := fs.Sub(nested, "migrations")
	require.NoError(t, err)
	require.NoError(t, migrations.Set{Name: "app", FS: sub, VersionTable: "app_version"}.Validate())
	require.ErrorContains(t, migrations.Set{Name: "app", FS: fstest.MapFS{}, VersionTable: "v"}.Validate(), "holds no .sql file")
}

// ferryMigrations is how many migrations Ferry's set holds.
func ferryMigrations(t *testing.T) int {
	t.Helper()
	files, err := fs.Glob(migrations.FS, "*.sql")
	require.NoError(t, err)
	return len(files)
}
