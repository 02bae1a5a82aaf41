package pgdb_test

import (
	"context"
	"errors"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A server that refuses the connection answers with a code of its own
// (here 3D000, no such database; 55000 when a database does not accept
// connections, 28P01 for a password): still a failure to reach the
// database, never the message's. The connect error is checked before the
// server's code.
func TestRefusedConnectionsAreUnavailable(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	t.Parallel()
	u, err := url.Parse(pipelinetest.DatabaseURL())
	require.NoError(t, err)
	u.Path = "/" + pipelinetest.UniqueName("ferry_no_such_db_")
	pool, err := pgxpool.New(context.Background(), u.String())
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(context.Background(), `SELECT 1`)
	require.Error(t, err)
	require.Contains(t, err.Error(), "3D000", "the server's own answer: %v", err)
	require.True(t, pgdb.Unavailable(err), "%v", err)
	require.True(t, pipeline.IsInfrastructure(pgdb.MarkUnavailable(err)))

	require.False(t, pgdb.Unavailable(errors.New("provider said no")))
	require.False(t, pgdb.Unavailable(nil))
}

func TestValidateSchemaRefusesSystemSchemas(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"information_schema", "pg_catalog", "pg_toast", "PG_mine", "Information_Schema"} {
		require.Error(t, pgdb.ValidateSchema(s), s)
	}
	for _, s := range []string{"ferry", "orders_pg", "public"} {
		require.NoError(t, pgdb.ValidateSchema(s), s)
	}
	require.NotContains(t, pgdb.Redact("postgres://u:12/S3cret@h/db"), "S3cret")
	require.Equal(t, "host=h password=xxxxx", pgdb.Redact("host=h password=S3cret"), "a keyword/value string shows all but its password")
}
