// Package pipelinetest is the rig of Ferry's own tests: servers of a test's
// own (a RabbitMQ node, a PostgreSQL cluster), round-trip counting, and the
// public helpers of ferrytest under short names. Users test with ferrytest.
package pipelinetest

import (
	"context"
	"database/sql"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// The helpers a user's tests need live in ferrytest, the public test
// package; these names keep Ferry's own tests short.
const (
	DefaultDatabaseURL = ferrytest.DefaultDatabaseURL
	DefaultAMQPURL     = ferrytest.DefaultAMQPURL
)

var (
	DatabaseURL      = ferrytest.DatabaseURL
	AMQPURL          = ferrytest.AMQPURL
	UniqueName       = ferrytest.UniqueName
	Schema           = ferrytest.Schema
	Pool             = ferrytest.Pool
	Postgres         = ferrytest.Postgres
	Rabbit           = ferrytest.Rabbit
	TeardownTopology = ferrytest.TeardownTopology
	RequireDrained   = ferrytest.RequireDrained
	skipShort        = ferrytest.SkipShort
)

// Outbox returns an outbox publisher on the default table, failing the
// test if it cannot be built.
func Outbox(t testing.TB) *pgoutbox.Outbox {
	t.Helper()
	ob, err := pgoutbox.New(pgoutbox.Config{Table: OutboxTable(t)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ob
}

// RequireLogicalWAL fails the test at once, in one line that says how to
// fix it, when the shared PostgreSQL server is not set up for logical
// decoding (the CDC relay's tests and runs need wal_level=logical): without
// the check such a test fails minutes later, its reason in a child's log.
func RequireLogicalWAL(t testing.TB) {
	t.Helper()
	skipShort(t)
	conn, err := pgx.Connect(context.Background(), DatabaseURL())
	if err != nil {
		t.Fatalf("PostgreSQL is needed for this test: %v", err)
	}
	defer conn.Close(context.Background())
	var level string
	if err := conn.QueryRow(context.Background(), `SHOW wal_level`).Scan(&level); err != nil {
		t.Fatalf("reading wal_level: %v", err)
	}
	if level != "logical" {
		t.Fatalf("this test needs wal_level=logical (it is %s): psql -h 127.0.0.1 -U postgres -c \"ALTER SYSTEM SET wal_level = logical\", then restart PostgreSQL (.ci/run does both)", level)
	}
}

// AMQPURLWithVhost is AMQPURL with its virtual host replaced by vhost,
// whatever vhost AMQPURL names.
func AMQPURLWithVhost(t testing.TB, vhost string) string {
	t.Helper()
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatalf("FERRY_TEST_AMQP_URL: %v", err)
	}
	u.Path, u.RawPath = "/"+vhost, ""
	return u.String()
}

// MigrateDownTo takes the schema db is on down to migration version: a
// schema as an earlier version of Ferry left it, for an upgrade test.
func MigrateDownTo(t testing.TB, db *sql.DB, version int64) {
	t.Helper()
	ctx := context.Background()
	for {
		states, err := migrations.Status(ctx, db)
		if err != nil {
			t.Fatalf("reading the migrations' status: %v", err)
		}
		var applied int64
		for _, s := range states {
			if s.Applied {
				applied = max(applied, s.Version)
			}
		}
		if applied <= version {
			return
		}
		if err := migrations.Down(ctx, db); err != nil {
			t.Fatalf("migrating down from %d: %v", applied, err)
		}
	}
}
