package ferrytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// Default server addresses of the test helpers; FERRY_TEST_DATABASE_URL
// and FERRY_TEST_AMQP_URL name others.
const (
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	DefaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
)

// DatabaseURL is the PostgreSQL server tests use.
func DatabaseURL() string {
	if u := os.Getenv("FERRY_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultDatabaseURL
}

// AMQPURL is the RabbitMQ server tests use.
func AMQPURL() string {
	if u := os.Getenv("FERRY_TEST_AMQP_URL"); u != "" {
		return u
	}
	return DefaultAMQPURL
}

// OutboxTable is the outbox table the helpers read, Schema creates and
// AppConfig configures: FERRY_TEST_OUTBOX_TABLE, or the default. CI runs
// the suites that read or write the outbox once with another name, so
// that a read of "outbox" by name anywhere fails a test.
func OutboxTable() (pgoutbox.Table, error) {
	t, err := pgoutbox.ParseTable(os.Getenv("FERRY_TEST_OUTBOX_TABLE"))
	if err != nil {
		return t, fmt.Errorf("FERRY_TEST_OUTBOX_TABLE: %w", err)
	}
	return t, nil
}

// outboxTable is OutboxTable; Schema, which every test that has a schema
// called first, reported its error.
func outboxTable() pgoutbox.Table {
	t, _ := OutboxTable()
	return t
}

// UniqueName returns prefix followed by random hex, safe as a schema or
// queue name.
func UniqueName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// SkipShort skips the test under `go test -short`: it needs the servers.
func SkipShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
}

// Schema creates a fresh schema, migrated with Ferry's migrations and then
// the application's own sets (extra), and returns its name; it is dropped
// when the test ends. An unreachable server fails the test, saying so.
func Schema(t testing.TB, extra ...migrations.Set) string {
	t.Helper()
	SkipShort(t)
	// A bound for a stuck server, not a target: CREATE INDEX CONCURRENTLY
	// (migration 00024) waits for every older transaction of the database,
	// other tests' included, and a loaded CI machine took more than 30 s.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: DatabaseURL(), ApplicationName: "ferry-test-admin"})
	if err != nil {
		t.Fatalf("PostgreSQL is needed for this test: %v (start it: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start)", err)
	}
	defer admin.Close()
	tbl, err := OutboxTable()
	if err != nil {
		t.Fatal(err)
	}
	schema := UniqueName("ferry_test_")
	if err := pgdb.CreateSchema(ctx, admin, schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgdb.Open(ctx, pgdb.Config{URL: DatabaseURL(), ApplicationName: "ferry-test-admin"})
		if err != nil {
			t.Errorf("dropping test schema %s: %v", schema, err)
			return
		}
		defer admin.Close()
		if err := pgdb.DropSchema(ctx, admin, schema); err != nil {
			t.Errorf("dropping test schema: %v", err)
		}
	})
	pool := openPool(t, schema, "ferry-test-migrate")
	defer pool.Close()
	db := pgdb.SQLDB(pool)
	defer db.Close()
	for i, set := range append([]migrations.Set{migrations.Library}, extra...) {
		if _, err := set.Up(ctx, db); err != nil {
			t.Fatalf("migrating test schema %s (%s): %v", schema, set.Name, err)
		}
		if i == 0 {
			// Before the application's sets: they may read the outbox.
			if err := RenameOutbox(ctx, pool, tbl); err != nil {
				t.Fatalf("test schema %s: %v", schema, err)
			}
		}
	}
	return schema
}

func openPool(t testing.TB, schema, appName string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: DatabaseURL(), Schema: schema, ApplicationName: appName})
	if err != nil {
		t.Fatalf("PostgreSQL is needed for this test: %v", err)
	}
	return pool
}

// Pool returns a pool on schema (see Schema), closed when the test ends.
// appName shows in pg_stat_activity.
func Pool(t testing.TB, schema, appName string) *pgxpool.Pool {
	t.Helper()
	pool := openPool(t, schema, appName)
	t.Cleanup(pool.Close)
	return pool
}

// Postgres is Schema plus Pool: a pool on a fresh, migrated schema, with
// the application's own migration sets (extra) applied after Ferry's.
func Postgres(t testing.TB, extra ...migrations.Set) *pgxpool.Pool {
	t.Helper()
	return Pool(t, Schema(t, extra...), "ferry-test")
}

// Rabbit returns a RabbitMQ configuration with a namespace of its own (a
// prefix of every exchange and queue name), after checking that the broker
// answers. TeardownTopology deletes what the test declares.
func Rabbit(t testing.TB) rabbit.Config {
	t.Helper()
	SkipShort(t)
	conn, err := amqp.DialConfig(AMQPURL(), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatalf("RabbitMQ is needed for this test: cannot reach %s: %v (start it: rabbitmq-server -detached)", AMQPURL(), err)
	}
	_ = conn.Close()
	return rabbit.Config{URL: AMQPURL(), Namespace: UniqueName("ferrytest.") + "."}
}

// TeardownTopology deletes, when the test ends, every exchange and queue
// topo declared.
func TeardownTopology(t testing.TB, topo *rabbit.Topology) {
	t.Helper()
	t.Cleanup(func() {
		conn, err := amqp.Dial(topo.Config().URL)
		if err != nil {
			t.Errorf("tearing down RabbitMQ topology: %v", err)
			return
		}
		defer conn.Close()
		if err := topo.Teardown(conn); err != nil {
			t.Errorf("tearing down RabbitMQ topology: %v", err)
		}
	})
}

// RequireDrained waits until pool's outbox has nothing left to do: no
// undispatched row that is due, none waiting in the relay's backoff after a
// failed publish, and no handler's durable retry waiting for its time.
// Only rows delayed on purpose and never tried (Delay, DeliverAt) may
// still wait. It fails the test after timeout.
func RequireDrained(t testing.TB, pool *pgxpool.Pool, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var pending int
	for {
		err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM `+outboxTable().View(pgoutbox.StatePending)+` o WHERE (available_at <= now() OR attempts > 0 OR topic = $1)`, pipeline.RetryTopic).Scan(&pending)
		if err != nil {
			t.Fatalf("counting pending outbox rows: %v", err)
		}
		if pending == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("outbox not drained after %s: %d row(s) still due, in backoff or retrying", timeout, pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// RenameOutbox gives the outbox Ferry's migrations made in pool's schema,
// and its archive, the name tbl says (what Schema does under
// FERRY_TEST_OUTBOX_TABLE), with tbl's operator views in place of the
// default table's, which go: a read of the outbox by its default name
// fails. For a test of a service whose outbox has another name
// (FERRY_OUTBOX_TABLE). The default name changes nothing.
func RenameOutbox(ctx context.Context, pool *pgxpool.Pool, tbl pgoutbox.Table) error {
	def := pgoutbox.Table{}
	if tbl.BaseName() == def.BaseName() {
		return nil
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// Newest first: the failing and retrying views read the pending one.
		for i := len(pgoutbox.RowStates) - 1; i >= 0; i-- {
			s := pgoutbox.RowStates[i]
			if _, err := tx.Exec(ctx, `DROP VIEW `+def.View(s)); err != nil {
				return fmt.Errorf("dropping %s: %w", def.View(s), err)
			}
		}
		stmts := []string{
			`ALTER TABLE ` + def.Quoted() + ` RENAME TO ` + pgx.Identifier{tbl.BaseName()}.Sanitize(),
			`ALTER TABLE ` + def.Archive() + ` RENAME TO ` + pgx.Identifier{tbl.BaseName() + "_archive"}.Sanitize(),
		}
		for _, stmt := range stmts {
			if _, err := tx.Exec(ctx, stmt); err != nil {
				return fmt.Errorf("renaming the outbox to %s: %w", tbl, err)
			}
		}
		return tbl.EnsureViews(ctx, tx)
	})
}
