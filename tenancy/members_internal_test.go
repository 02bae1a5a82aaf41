package tenancy

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// testDatabaseURL is the shared test database (ferrytest's rule; ferrytest
// itself imports this package).
func testDatabaseURL(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("needs PostgreSQL (go test -short skips it)")
	}
	return cmp.Or(os.Getenv("FERRY_TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
}

// migratedSchema is a schema of the test's own with Ferry's tables,
// dropped when the test ends.
func migratedSchema(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	url := testDatabaseURL(t)
	schema := fmt.Sprintf("tenancy_test_%d", time.Now().UnixNano())
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: url, ApplicationName: "ferry-test"})
	require.NoError(t, err, "PostgreSQL at %s", url)
	t.Cleanup(admin.Close)
	require.NoError(t, pgdb.CreateSchema(ctx, admin, schema))
	t.Cleanup(func() { _ = pgdb.DropSchema(context.Background(), admin, schema) })
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: url, Schema: schema, ApplicationName: "ferry-test"})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, pgdb.CheckSchema(ctx, pool, schema))
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { _ = db.Close() })
	_, err = migrations.Library.Up(ctx, db)
	require.NoError(t, err)
	return pool
}

// A member whose process dies loses its lock with its session, and stops
// counting at once, not once its heartbeat is stale (15 s, its tenants
// unserved meanwhile); a member just started counts before its lock.
func TestAMemberCountsWhileItsProcessHoldsItsLock(t *testing.T) {
	ctx := context.Background()
	pool := migratedSchema(t)
	_, err := pgstatus.NewHeartbeat(ctx, pool, "m1", []string{"relay", Component}, "test")
	require.NoError(t, err)
	members, err := Members(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, []string{"m1"}, members, "a member just started counts before its lock")
	_, err = pool.Exec(ctx, `UPDATE ferry_instances SET started_at = now() - interval '1 minute'`)
	require.NoError(t, err)
	members, err = Members(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, members, "a heartbeat without its lock, past the grace, is no member")

	f := &Fleet{control: pool, cfg: Config{Member: "m1"}, logger: slog.New(slog.DiscardHandler)}
	run, die := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); f.holdMembership(run) }()
	require.Eventually(t, func() bool {
		members, err := Members(ctx, pool)
		return err == nil && len(members) == 1
	}, 5*time.Second, 20*time.Millisecond, "a member holding its lock counts")

	die()
	<-done
	died := time.Now()
	require.Eventually(t, func() bool {
		members, err := Members(ctx, pool)
		return err == nil && len(members) == 0
	}, 2*time.Second, 20*time.Millisecond, "its heartbeat still fresh, a member whose session ended is no member")
	t.Logf("no member %s after its session ended", time.Since(died).Round(time.Millisecond))
}
