package main

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pgconn"
	"github.com/ferry-dev/ferry/pipeline/pipelinetest"
)

func TestHelpListsEveryCommand(t *testing.T) {
	var out, errOut strings.Builder
	require.Equal(t, 0, run([]string{"help"}, &out, &errOut))
	for _, cmd := range []string{"demo", "sandbox", "run", "relay", "consume", "bench", "chaos", "status", "poison list", "poison requeue", "poison discard",
		"prune outbox", "prune ledger", "migrate up", "migrate down", "migrate status", "healthcheck", "help", "version"} {
		require.Contains(t, out.String(), "  "+cmd, "ferry help must document %q", cmd)
	}
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	for _, cmd := range []string{"demo", "sandbox", "run", "relay", "consume", "bench", "chaos", "status", "poison list", "poison requeue",
		"poison discard", "prune outbox", "prune ledger", "migrate up", "migrate down", "migrate status", "healthcheck", "help", "version"} {
		require.Contains(t, string(readme), "`ferry "+cmd, "the README must document ferry %s", cmd)
	}
	for _, ev := range append(app.EnvVars(), options().EnvVars...) {
		require.Contains(t, string(readme), "| `"+ev.Name+"` |", "the README's configuration table must list %s", ev.Name)
	}
	out.Reset()
	require.Equal(t, 0, run([]string{"help", "config"}, &out, &errOut))
	require.Contains(t, out.String(), "FERRY_DATABASE_URL")
}

// Every command and sub-command answers -h (and --help, and `help <cmd>`)
// with its own flags and exit status 0.
func TestEveryCommandHasHelp(t *testing.T) {
	for _, path := range [][]string{{"run"}, {"relay"}, {"consume"}, {"migrate"}, {"migrate", "up"}, {"migrate", "down"}, {"migrate", "status"},
		{"status"}, {"poison"}, {"poison", "list"}, {"poison", "requeue"}, {"poison", "discard"}, {"prune"}, {"prune", "outbox"}, {"prune", "ledger"},
		{"healthcheck"}, {"demo"}, {"sandbox"}, {"bench"}, {"chaos"}, {"help"}, {"version"}} {
		for _, h := range []string{"-h", "--help"} {
			var out, errOut strings.Builder
			require.Equal(t, 0, run(append(slices.Clone(path), h), &out, &errOut), "ferry %v %s: %s", path, h, errOut.String())
			require.Contains(t, out.String(), "ferry "+strings.Join(path, " ")+":", "ferry %v %s prints the command's help", path, h)
			require.Contains(t, out.String(), "Usage:")
		}
		var out, errOut strings.Builder
		require.Equal(t, 0, run(append([]string{"help"}, path...), &out, &errOut))
		require.Contains(t, out.String(), "ferry "+strings.Join(path, " ")+":")
	}
	var out, errOut strings.Builder
	require.Equal(t, 0, run([]string{"poison", "requeue", "-h"}, &out, &errOut))
	for _, flag := range []string{"-dry-run", "-id", "-topic", "-all", "-limit", "-json"} {
		require.Contains(t, out.String(), flag)
	}
}

func TestUsageErrors(t *testing.T) {
	var out, errOut strings.Builder
	require.Equal(t, 2, run(nil, &out, &errOut))
	require.Equal(t, 2, run([]string{"frobnicate"}, &out, &errOut))
	require.Contains(t, errOut.String(), `unknown command "frobnicate"`)
	errOut.Reset()
	require.Equal(t, 2, run([]string{"run", "--bogus"}, &out, &errOut))
	require.Equal(t, 2, run([]string{"migrate", "sideways"}, &out, &errOut))
	// A requeue or discard that selects nothing, or too much, is refused before connecting.
	errOut.Reset()
	require.Equal(t, 2, run([]string{"poison", "requeue"}, &out, &errOut))
	require.Contains(t, errOut.String(), "exactly one of --id, --topic or --all")
	require.Equal(t, 2, run([]string{"poison", "discard", "--all", "--topic", "x"}, &out, &errOut))
	require.Equal(t, 2, run([]string{"poison", "requeue", "--id", "abc"}, &out, &errOut))
	require.Equal(t, 2, run([]string{"prune", "ledger", "--older-than", "1m"}, &out, &errOut))
	require.Equal(t, 2, run([]string{"prune", "everything"}, &out, &errOut))
}

func TestBadConfigurationIsOneActionableLine(t *testing.T) {
	t.Setenv("FERRY_RELAY_POLL_INTERVAL", "soon")
	t.Setenv("FERRY_LOG_LEVEL", "loud")
	t.Setenv("FERRY_AMQP_URL", "http://nope")
	var out, errOut strings.Builder
	require.Equal(t, 1, run([]string{"run"}, &out, &errOut))
	msg := errOut.String()
	require.Equal(t, 1, strings.Count(msg, "\n"), "one line: %q", msg)
	require.Contains(t, msg, "FERRY_RELAY_POLL_INTERVAL")
	require.Contains(t, msg, "FERRY_LOG_LEVEL")
	require.Contains(t, msg, "amqp://")
}

func TestUnreachableDatabaseIsReported(t *testing.T) {
	t.Setenv("FERRY_DATABASE_URL", "postgres://postgres@127.0.0.1:1/none?connect_timeout=2")
	var out, errOut strings.Builder
	require.Equal(t, 1, run([]string{"relay"}, &out, &errOut))
	require.Contains(t, errOut.String(), "cannot reach PostgreSQL at postgres://postgres@127.0.0.1:1/none")
	require.Contains(t, errOut.String(), "check FERRY_DATABASE_URL")
	require.Equal(t, 1, strings.Count(errOut.String(), "\n"))
}

func TestWrongCredentialsAreOneActionableLine(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	for name, env := range map[string][2]string{
		"database": {"FERRY_DATABASE_URL", "postgres://nosuchuser@127.0.0.1:5432/test?sslmode=disable"},
		"broker":   {"FERRY_AMQP_URL", "amqp://guest:wrong-password@127.0.0.1:5672/"},
	} {
		t.Run(name, func(t *testing.T) {
			// Never outside the test database, in a schema of the test's own.
			t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
			t.Setenv("FERRY_DATABASE_SCHEMA", pipelinetest.Schema(t))
			t.Setenv(env[0], env[1])
			var out, errOut strings.Builder
			require.Equal(t, 1, run([]string{"relay", "--migrate"}, &out, &errOut))
			msg := errOut.String()
			require.Equal(t, 1, strings.Count(msg, "\n"), "one line: %q", msg)
			require.NotContains(t, msg, "wrong-password", "credentials never reach the output")
			switch name {
			case "database":
				require.Contains(t, msg, "nosuchuser")
				require.Contains(t, msg, "check the user, password and database in FERRY_DATABASE_URL")
			case "broker":
				require.Contains(t, msg, "username or password not allowed")
				require.Contains(t, msg, "check the user, password and vhost in FERRY_AMQP_URL")
			}
		})
	}
}

// FERRY_DATABASE_SCHEMA is one identifier, used exactly as written: a
// comma or mixed case never spreads tables into another schema, and the
// migration lands in the schema named or nowhere.
func TestMigrateIntoTheSchemaNamedOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	ctx := context.Background()
	admin, err := pgconn.Open(ctx, pgconn.Config{URL: pipelinetest.DatabaseURL()})
	require.NoError(t, err)
	defer admin.Close()
	publicTables := func() int {
		var n int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename IN ('outbox', 'ferry_schema_version')`).Scan(&n))
		return n
	}
	before := publicTables()
	for _, schema := range []string{pipelinetest.UniqueName("ferry_test_") + ",public", pipelinetest.UniqueName("Ferry_Test_Mixed")} {
		t.Run(schema, func(t *testing.T) {
			t.Cleanup(func() { _ = pgconn.DropSchema(context.Background(), admin, schema) })
			t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
			t.Setenv("FERRY_DATABASE_SCHEMA", schema)
			var out, errOut strings.Builder
			require.Equal(t, 0, run([]string{"migrate", "up"}, &out, &errOut), errOut.String())
			var n int
			require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox'`, schema).Scan(&n))
			require.Equal(t, 1, n, "the outbox is in the schema named %q", schema)
			require.Equal(t, before, publicTables(), "nothing lands in public")
			out.Reset()
			require.Equal(t, 0, run([]string{"migrate", "status"}, &out, &errOut), errOut.String())
			require.NotContains(t, out.String(), "pending")
		})
	}
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", strings.Repeat("s", 64))
	var out, errOut strings.Builder
	require.Equal(t, 1, run([]string{"migrate", "up"}, &out, &errOut))
	require.Contains(t, errOut.String(), "FERRY_DATABASE_SCHEMA")
}
