package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// commandPaths are every command and sub-command of the binary, from its
// command table: a command added there is checked here without a list to
// keep.
func commandPaths() [][]string {
	var paths [][]string
	var walk func(prefix []string, cmds []*cli.Command)
	walk = func(prefix []string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := append(slices.Clone(prefix), c.Name)
			paths = append(paths, p)
			walk(p, c.Sub)
		}
	}
	walk(nil, append(cli.Commands(), options().Commands...))
	return append(paths, []string{"help"}, []string{"version"})
}

func TestHelpListsEveryCommand(t *testing.T) {
	var out, errOut strings.Builder
	require.Equal(t, 0, run([]string{"help"}, &out, &errOut))
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	docs, err := os.ReadFile("../../docs/commands.md")
	require.NoError(t, err)
	for _, path := range commandPaths() {
		cmd := strings.Join(path, " ")
		assert.Contains(t, out.String(), "  "+cmd, "ferry help must document %q", cmd)
		assert.Contains(t, string(readme), "`ferry "+cmd, "the README must document ferry %s", cmd)
		assert.Contains(t, string(docs), "`ferry "+cmd, "docs/commands.md must document ferry %s", cmd)
	}
	out.Reset()
	require.Equal(t, 0, run([]string{"help", "config"}, &out, &errOut))
	require.Contains(t, out.String(), "FERRY_DATABASE_URL")
}

// Every command and sub-command answers -h (and --help, and `help <cmd>`)
// with its own flags and exit status 0.
func TestEveryCommandHasHelp(t *testing.T) {
	for _, path := range commandPaths() {
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
	require.Contains(t, errOut.String(), "exactly one of --id, --topic/--filter or --all")
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

// A credential never shows, in whatever form pgx takes it: the user
// information, a password= query parameter, a keyword/value string. The
// commands that print the database's address (status, run, relay) print
// it redacted.
func TestCredentialsNeverPrinted(t *testing.T) {
	for _, url := range []string{
		"postgres://postgres@127.0.0.1:1/none?password=S3cretPw&connect_timeout=2",
		"postgres://postgres:S3cretPw@127.0.0.1:1/none?connect_timeout=2",
		"postgres://postgres@127.0.0.1:1/none?sslpassword=S3cretPw&connect_timeout=2",
	} {
		for _, cmd := range [][]string{{"status"}, {"run"}, {"relay"}} {
			t.Setenv("FERRY_DATABASE_URL", url)
			var out, errOut strings.Builder
			code := run(cmd, &out, &errOut)
			require.NotZero(t, code, "%v with an unreachable database", cmd)
			require.NotContains(t, out.String()+errOut.String(), "S3cretPw", "%v printed the password of %s", cmd, url)
			require.Contains(t, out.String()+errOut.String(), "127.0.0.1", "%v still says where", cmd)
		}
	}
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
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: pipelinetest.DatabaseURL()})
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
			t.Cleanup(func() { _ = pgdb.DropSchema(context.Background(), admin, schema) })
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

// A catch-up page smaller than a claim is refused, by the variables' names.
func TestCatchUpBatchSizeBelowBatchSizeIsRefused(t *testing.T) {
	t.Setenv("FERRY_RELAY_BATCH_SIZE", "500")
	t.Setenv("FERRY_RELAY_CATCH_UP_BATCH_SIZE", "200")
	var out, errOut strings.Builder
	require.Equal(t, 1, run([]string{"relay"}, &out, &errOut))
	require.Contains(t, errOut.String(), "FERRY_RELAY_CATCH_UP_BATCH_SIZE: must be at least FERRY_RELAY_BATCH_SIZE (500), got 200")
	require.NotContains(t, errOut.String(), "RelayConfig")
}

// What a newcomer gets wrong in the environment is named by its variable;
// a set 0 is refused, not silently the default; a misspelt variable is
// warned about with the nearest name.
func TestConfigurationErrorsNameTheVariable(t *testing.T) {
	t.Setenv("FERRY_RELAY_BATCH_SIZE", "0")
	t.Setenv("FERRY_RETRY_INITIAL_INTERVAL", "5s") // above the default max of 2s
	t.Setenv("FERRY_ADMIN_TOKEN", "short")
	t.Setenv("FERRY_DATABASE_SCHEMA", strings.Repeat("x", 70))
	var out, errOut strings.Builder
	require.Equal(t, 1, run([]string{"relay"}, &out, &errOut))
	msg := errOut.String()
	require.Contains(t, msg, `FERRY_RELAY_BATCH_SIZE="0": must be in [1, 10000]`)
	require.Contains(t, msg, "FERRY_RETRY_MAX_INTERVAL: must be at least FERRY_RETRY_INITIAL_INTERVAL")
	require.Contains(t, msg, "FERRY_ADMIN_TOKEN: must be at least 16 characters")
	require.Contains(t, msg, "FERRY_DATABASE_SCHEMA")
	for _, goName := range []string{"RelayConfig", "RetryConfig", "BatchSize", "InitialInterval"} {
		require.NotContains(t, msg, goName, "errors name variables, not Go fields")
	}

	cfg, err := app.ConfigFromLookup(func(k string) (string, bool) {
		return map[string]string{"FERRY_RETRY_MAX": "0"}[k], k == "FERRY_RETRY_MAX"
	})
	require.NoError(t, err)
	// The chain applies the defaults again: "none" must survive that.
	retry, err := cfg.Retry.WithDefaults().Middleware(nil)
	require.NoError(t, err)
	calls := 0
	_, err = retry(func(*message.Message) ([]*message.Message, error) { calls++; return nil, errors.New("boom") })(message.NewMessage("m", nil))
	require.Error(t, err)
	require.Equal(t, 1, calls, "FERRY_RETRY_MAX=0 means no quick retries, not the default 3")

	warnings := app.UnknownVariables([]string{"FERRY_RELAY_BACTH_SIZE=5", "FERRY_DATABASE_URL=x", "HOME=/root", "FERRY_TOTALLY_ELSE=1"}, nil)
	require.Equal(t, []string{
		"FERRY_RELAY_BACTH_SIZE is not a variable Ferry or this application reads; it is ignored (did you mean FERRY_RELAY_BATCH_SIZE?)",
		"FERRY_TOTALLY_ELSE is not a variable Ferry or this application reads; it is ignored",
	}, warnings)
	t.Setenv("FERRY_RELAY_BACTH_SIZE", "5")
	errOut.Reset()
	run([]string{"relay"}, &out, &errOut)
	require.Contains(t, errOut.String(), "ferry: warning: FERRY_RELAY_BACTH_SIZE is not a variable")
}

// healthcheck uses credentials in --url but never prints them.
func TestHealthcheckNeverPrintsCredentials(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "probe" || p != "hunter2-secret" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"database":"unreachable"}`))
	}))
	defer srv.Close()
	withCreds := strings.Replace(srv.URL, "http://", "http://probe:hunter2-secret@", 1)
	for _, url := range []string{withCreds + "/readyz", "http://probe:hunter2-secret@127.0.0.1:1/readyz"} {
		var out, errOut strings.Builder
		require.Equal(t, 1, run([]string{"healthcheck", "--url", url}, &out, &errOut))
		require.NotContains(t, errOut.String()+out.String(), "hunter2", url)
		require.Contains(t, errOut.String(), "probe:xxxxx@")
	}
}

// The poison and status commands on a store with hostile and plentiful
// content: escaped and cut tables, exact JSON, paging, unknown ids named,
// exit codes that say when a human is needed.
func TestPoisonAndStatusCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	schema := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	t.Setenv("FERRY_AMQP_URL", pipelinetest.AMQPURL())
	t.Setenv("FERRY_AMQP_NAMESPACE", pipelinetest.UniqueName("ferrytest.")+".")
	pool := pipelinetest.Pool(t, schema, "ferry-test-cli")
	hostile := "\x1b[2J\x1b[31mowned\u202etxt.exe " + strings.Repeat("x", 5000)
	ids := pipelinetest.InsertPoison(t, pool,
		pipelinetest.PoisonRow{MessageID: hostile, Topic: "mail.send", Handler: "notifications.mail", Payload: `{"a":1}`, Reason: hostile,
			Headers: map[string]string{"ferry_error_history": `[{"attempt":1,"at":"t","error":"first"}]`}},
		pipelinetest.PoisonRow{MessageID: "plain", Topic: "mail.send", Handler: "notifications.mail", Payload: "raw bytes", Reason: "boom"})

	cmd := func(args ...string) (int, string, string) {
		var out, errOut strings.Builder
		code := run(args, &out, &errOut)
		return code, out.String(), errOut.String()
	}
	code, out, _ := cmd("poison", "list")
	require.Equal(t, 0, code)
	require.NotContains(t, out, "\x1b", "no raw escape reaches the terminal")
	require.NotContains(t, out, "\u202e")
	require.Contains(t, out, `\x1b[2J`)
	for _, line := range strings.Split(out, "\n") {
		require.Less(t, len([]rune(line)), 400, "cells are cut: %q", line)
	}
	code, out, _ = cmd("poison", "list", "--json", "--limit", "0")
	require.Equal(t, 0, code)
	var recs []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &recs), out)
	require.Len(t, recs, 2)
	require.Equal(t, hostile, recs[0]["reason"], "JSON stays exact")
	code, out, _ = cmd("poison", "list", "--json", "--after-id", strconv.FormatInt(ids[0], 10))
	require.Equal(t, 0, code)
	require.NoError(t, json.Unmarshal([]byte(out), &recs))
	require.Len(t, recs, 1, "the next page")

	for _, bad := range [][]string{{"poison", "list", "--limit", "-1"}, {"poison", "list", "--limit", "99999999999"}, {"poison", "requeue", "--all", "--after-id", "-5"}} {
		code, _, errOut := cmd(bad...)
		require.Equal(t, 2, code, "%v", bad)
		require.Contains(t, errOut, "must", "%v: a clear message, not SQL", bad)
		require.NotContains(t, errOut, "SQLSTATE")
	}

	code, out, _ = cmd("poison", "show", strconv.FormatInt(ids[0], 10))
	require.Equal(t, 0, code)
	require.Contains(t, out, strings.Repeat("x", 5000), "show keeps the reason whole")
	require.NotContains(t, out, "\x1b")
	require.Contains(t, out, "attempt history")
	require.Contains(t, out, "#1  t  first")
	require.Contains(t, out, `"a": 1`)
	// Flags after the argument, as the docs write command lines.
	code, out, errOut := cmd("poison", "show", strconv.FormatInt(ids[0], 10), "--json")
	require.Equal(t, 0, code, errOut)
	require.True(t, json.Valid([]byte(out)), out)
	code, _, errOut = cmd("poison", "show", "999999")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "no such poisoned message")

	code, out, errOut = cmd("poison", "discard", "--id", strconv.FormatInt(ids[1], 10)+",999999")
	require.Equal(t, 1, code, "an unknown id fails the command")
	require.Contains(t, out, "discarded 1 message(s)")
	require.Contains(t, errOut, "no poisoned message with id 999999")
	// Grouping and filters, as in the console; the discard above is audited.
	code, out, _ = cmd("poison", "list", "--group")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "COUNT")
	require.NotContains(t, out, "\x1b")
	code, out, _ = cmd("poison", "list", "--filter", "handler=notifications.mail,text=OWNED", "--json")
	require.Equal(t, 0, code, out)
	require.NoError(t, json.Unmarshal([]byte(out), &recs))
	require.Len(t, recs, 1)
	code, _, errOut = cmd("poison", "list", "--filter", "colour=red")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "unknown key")
	code, out, _ = cmd("audit")
	require.Equal(t, 0, code)
	require.Contains(t, out, "poison.discard")
	require.Contains(t, out, "ids "+strconv.FormatInt(ids[1], 10))

	// The one left has a 5,000-byte id the outbox cannot take: the dry run
	// finds that as the real run would, names it and fails.
	code, out, errOut = cmd("poison", "requeue", "--all", "--dry-run")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "would requeue 0 message(s)")
	require.Contains(t, out, "skipped poison id "+strconv.FormatInt(ids[0], 10)+": cannot be written back")
	require.Contains(t, errOut, "1 message(s) skipped")

	code, out, _ = cmd("status")
	require.Equal(t, 3, code, "a poisoned message and no live relay need a human:\n%s", out)
	require.Contains(t, out, "needs attention:")
	require.Contains(t, out, "no live relay")
	require.NotContains(t, out, "\x1b")
	code, out, _ = cmd("status", "--exit-code=false", "--json")
	require.Equal(t, 0, code)
	var rep map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.NotEmpty(t, rep["attention"])
	require.Contains(t, rep, "unrouted")
	require.NotEmpty(t, rep["audit"], "status --json carries the audit log")

	code, out, _ = cmd("prune", "outbox", "--archive", "--dry-run")
	require.Equal(t, 0, code)
	require.Contains(t, out, "would archive 0 row(s)")
	require.Contains(t, out, "in 1 batch(es)")
}

// ferry shadow report gates the switch-over: 1 with a mismatch on either
// side (named, with samples), 0 once the sides agree. ferry backfill is a
// dry run unless --apply, refuses past --max, and writes each intent once.
func TestShadowReportAndBackfillCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	schema := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	t.Setenv("FERRY_SHADOW_TOPICS", "mail.send")
	pool := pipelinetest.Pool(t, schema, "ferry-test-cli")
	ctx := context.Background()
	tbl := pipelinetest.OutboxTable(t)
	pipelinetest.InsertOutbox(t, pool, tbl,
		pipelinetest.OutboxRow{MessageUUID: "m1", AggregateID: "o-1", Topic: "mail.send", Shadowed: true, Dispatched: true},
		pipelinetest.OutboxRow{MessageUUID: "m2", AggregateID: "o-2", Topic: "mail.send", Shadowed: true, Dispatched: true})
	recordLegacy(t, pool, "o-2", "o-3")
	cmd := func(args ...string) (int, string, string) {
		var out, errOut strings.Builder
		code := run(args, &out, &errOut)
		return code, out.String(), errOut.String()
	}
	code, out, errOut := cmd("shadow", "report")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "MISMATCH")
	require.Contains(t, out, "legacy effect, no intent (sample): o-3")
	require.Contains(t, out, "intent, no legacy effect (sample): o-1")
	require.Contains(t, errOut, "do not switch over yet")
	code, out, _ = cmd("shadow", "report", "--json")
	require.Equal(t, 1, code)
	var rep struct {
		Agree  bool `json:"agree"`
		Topics []struct {
			Matched, MissingInOutboxCount, MissingInLegacyCount int
		} `json:"topics"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.False(t, rep.Agree)
	require.Equal(t, 1, rep.Topics[0].Matched)
	recordLegacy(t, pool, "o-1")
	pipelinetest.InsertOutbox(t, pool, tbl,
		pipelinetest.OutboxRow{MessageUUID: "m3", AggregateID: "o-3", Topic: "mail.send", Headers: map[string]string{pipeline.MetaShadow: "true"}})
	code, out, _ = cmd("shadow", "report", "--topic", "mail.send")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "agree")

	_, err := pool.Exec(ctx, `CREATE TABLE signups (id int, welcomed bool); INSERT INTO signups SELECT g, false FROM generate_series(1, 12) g`)
	require.NoError(t, err)
	q := `SELECT id AS aggregate_id, json_build_object('user_id', id) AS payload FROM signups WHERE NOT welcomed`
	before, err := tbl.Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	code, out, _ = cmd("backfill", "--name", "welcome", "--topic", "mail.welcome", "--query", q, "--spread", "30m")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "would write 12 intent(s) (dry run: nothing written")
	require.Equal(t, 3, strings.Count(out, "sample: "))
	require.Contains(t, out, "schedule: from ")
	code, _, errOut = cmd("backfill", "--name", "welcome", "--topic", "mail.welcome", "--query", q, "--apply", "--max", "5")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "12 rows, --max 5")
	for range 2 {
		code, out, _ = cmd("backfill", "--name", "welcome", "--topic", "mail.welcome", "--query", q, "--apply", "--json")
		require.Equal(t, 0, code, out)
	}
	require.Contains(t, out, `"already_written": 12`)
	after, err := tbl.Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	require.Len(t, after, len(before)+12, "twice --apply, each intent once")
}

// recordLegacy records the legacy system's mail.send effects on these
// aggregates, as its code does (shadow.RecordLegacy).
func recordLegacy(t *testing.T, pool *pgxpool.Pool, aggregates ...string) {
	t.Helper()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	for _, a := range aggregates {
		require.NoError(t, shadow.RecordLegacy(context.Background(), db, "mail.send", a))
	}
}

// The edge cases of configuration an operator met: each refused at start,
// naming the variable, with nothing secret or terminal-driving printed.
func TestConfigurationEdgesAreRefusedByVariable(t *testing.T) {
	for _, tc := range []struct{ name, value, want string }{
		{"FERRY_DATABASE_SCHEMA", "information_schema", "FERRY_DATABASE_SCHEMA"},
		{"FERRY_DATABASE_SCHEMA", "pg_mine", "FERRY_DATABASE_SCHEMA"},
		{"FERRY_AMQP_NAMESPACE", "amq.mine.", "FERRY_AMQP_NAMESPACE"},
		{"FERRY_MAIL_FROM", "not an address", "FERRY_MAIL_FROM"},
		{"FERRY_MAIL_RECIPIENT_DOMAIN", "bad domain", "FERRY_MAIL_RECIPIENT_DOMAIN"},
		{"FERRY_HTTP_ALLOWED_HOSTS", "http://x:1", "FERRY_HTTP_ALLOWED_HOSTS"},
	} {
		t.Run(tc.name+"="+tc.value, func(t *testing.T) {
			t.Setenv(tc.name, tc.value)
			var out, errOut strings.Builder
			require.Equal(t, 1, run([]string{"relay"}, &out, &errOut))
			require.Contains(t, errOut.String(), tc.want)
			require.NotContains(t, errOut.String(), "credentials")
		})
	}
	t.Run("secrets and escapes", func(t *testing.T) {
		// Refused before any connection: the driver would read the password
		// as the host or the database, and print it.
		for _, u := range []string{"postgres://127.0.0.1:12/S3cret@127.0.0.1:1/db", "postgres://u:a@S3cret@127.0.0.1:1/db", "postgres://u:a?S3cret@127.0.0.1:1/db\x1b[31m"} {
			t.Setenv("FERRY_DATABASE_URL", u)
			var out, errOut strings.Builder
			require.Equal(t, 1, run([]string{"status"}, &out, &errOut))
			require.Contains(t, errOut.String(), "FERRY_DATABASE_URL")
			require.Contains(t, errOut.String(), "percent-encode")
			require.NotContains(t, errOut.String(), "S3cret")
			require.NotContains(t, errOut.String(), "\x1b")
		}
	})
}

// A broker that answers but has no Ferry topology yet (no relay has run on
// the vhost, or FERRY_AMQP_NAMESPACE names another) is not reported as
// unreachable: status says which queue is missing and what to start.
func TestStatusTellsAMissingQueueFromAnUnreachableBroker(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	rmq := pipelinetest.Rabbit(t) // a namespace nothing was declared in
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", pipelinetest.Schema(t))
	t.Setenv("FERRY_AMQP_URL", rmq.URL)
	t.Setenv("FERRY_AMQP_NAMESPACE", rmq.Namespace)
	var out, errOut strings.Builder
	run([]string{"status"}, &out, &errOut)
	require.NotContains(t, out.String(), "RabbitMQ unreachable", out.String()+errOut.String())
	require.Contains(t, out.String(), rmq.Namespace+"ferry.unrouted does not exist")
	require.Contains(t, out.String(), "relay")
}

// On a schema without Ferry's tables (never migrated, or the wrong
// FERRY_DATABASE_SCHEMA), the reading commands fail at once with one line
// that says what to do, printing nothing else; with the broker unreachable
// status names it among what needs attention and exits 3.
func TestCommandsSayWhatToDoOnAnUnmigratedSchemaOrWithoutBroker(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	empty := pipelinetest.UniqueName("ferry_empty_")
	pool := pipelinetest.Pool(t, "public", "ferry-test-cli")
	_, err := pool.Exec(context.Background(), `CREATE SCHEMA `+empty)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA `+empty+` CASCADE`) })
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", empty)
	for _, args := range [][]string{{"status"}, {"poison", "list"}, {"poison", "list", "--json"}, {"audit"}, {"prune", "outbox", "--dry-run"}} {
		var out, errOut strings.Builder
		code := run(args, &out, &errOut)
		require.Equal(t, 1, code, "%v: %s", args, errOut.String())
		require.Empty(t, out.String(), "%v prints nothing before the error", args)
		require.Contains(t, errOut.String(), "migrate up", args)
		require.Equal(t, 1, strings.Count(strings.TrimSpace(errOut.String()), "\n")+1, "%v: one line: %s", args, errOut.String())
		require.NotContains(t, errOut.String(), "does not exist (SQLSTATE", args)
	}

	schema := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	t.Setenv("FERRY_AMQP_URL", "amqp://guest:guest@127.0.0.1:1/")
	var out, errOut strings.Builder
	require.Equal(t, 3, run([]string{"status"}, &out, &errOut), out.String()+errOut.String())
	attention := out.String()[strings.Index(out.String(), "needs attention"):]
	require.Contains(t, attention, "RabbitMQ unreachable")
	require.NotContains(t, out.String(), "needs attention: nothing")
}

var update = flag.Bool("update", false, "rewrite docs/configuration.md from the variables' table")

// docs/configuration.md is generated from the table the binary reads
// (app.EnvVars and this binary's own): a variable added, removed or
// re-documented without regenerating it fails here.
func TestConfigurationReference(t *testing.T) {
	var b strings.Builder
	require.NoError(t, cli.WriteConfigReference(&b, "ferry", envVars()))
	const page = "../../docs/configuration.md"
	if *update {
		require.NoError(t, os.WriteFile(page, []byte(b.String()), 0o644))
	}
	got, err := os.ReadFile(page)
	require.NoError(t, err)
	require.Equal(t, b.String(), string(got), "docs/configuration.md is stale: go test ./cmd/ferry/ -run TestConfigurationReference -update")
	for _, ev := range append(app.EnvVars(), envVars()...) {
		require.Contains(t, string(got), "| `"+ev.Name+"` |")
	}
}

// Durable retries are where messages wait while a dependency is down:
// status names them by handler with their next try, since when they fail
// and why, and calls for a human.
func TestStatusShowsDurableRetries(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	schema := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	t.Setenv("FERRY_AMQP_URL", pipelinetest.AMQPURL())
	pool := pipelinetest.Pool(t, schema, "ferry-test-cli-retry")
	var rows []pipelinetest.OutboxRow
	for g := 1; g <= 35; g++ {
		rows = append(rows, pipelinetest.OutboxRow{MessageUUID: fmt.Sprint("m", g), AggregateID: fmt.Sprint("o", g), Topic: pipeline.RetryTopic,
			Headers: map[string]string{"ferry_retry_queue": "notifications.mail", "ferry_attempt": "3",
				"ferry_last_error":      fmt.Sprintf("mailing order %d: SMTP RCPT TO: 451 try again later", g),
				"ferry_first_failed_at": "2026-12-03T10:00:00Z"},
			AvailableAt: time.Now().Add(time.Minute)})
	}
	pipelinetest.InsertOutbox(t, pool, pipelinetest.OutboxTable(t), rows...)
	var out, errOut strings.Builder
	require.Equal(t, 3, run([]string{"status"}, &out, &errOut), errOut.String())
	require.Contains(t, out.String(), "durable retries: 35 message(s) waiting for their handler")
	require.Contains(t, out.String(), "notifications.mail")
	require.Contains(t, out.String(), "451 try again later")
	attention := out.String()[strings.Index(out.String(), "needs attention:"):]
	require.Contains(t, attention, "35 message(s) retrying (most: 35 for notifications.mail, failing since 2026-12-03T10:00:00Z")

	out.Reset()
	require.Equal(t, 0, run([]string{"status", "--json", "--exit-code=false"}, &out, &errOut))
	var rep struct {
		RetryingTotal int `json:"retrying_total"`
		Retrying      []struct {
			Handler    string `json:"handler"`
			Count      int    `json:"count"`
			MaxAttempt int    `json:"max_next_attempt"`
		} `json:"retrying"`
	}
	require.NoError(t, json.Unmarshal([]byte(out.String()), &rep))
	require.Equal(t, 35, rep.RetryingTotal)
	require.Len(t, rep.Retrying, 1, "one handler, one fingerprint (the order numbers normalised)")
	require.Equal(t, 3, rep.Retrying[0].MaxAttempt)
}

// poison list says how many there are under the filter and how to read
// on; it filters by correlation and message id; it fits COLUMNS; its JSON
// has the payload and the error history as JSON values.
func TestPoisonListTotalsFiltersWidthAndJSON(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	schema := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	pool := pipelinetest.Pool(t, schema, "ferry-test-cli-list")
	var rows []pipelinetest.PoisonRow
	for g := 1; g <= 7; g++ {
		rows = append(rows, pipelinetest.PoisonRow{MessageID: fmt.Sprint("m", g), Topic: "mail.send", Handler: "notifications.mail",
			Payload: fmt.Sprintf(`{"n":%d}`, g), Reason: strings.Repeat("long reason ", 30), CorrelationID: fmt.Sprint("corr-", g%2),
			Headers: map[string]string{"ferry_error_history": `[{"attempt":1,"at":"t","error":"first"}]`}})
	}
	pipelinetest.InsertPoison(t, pool, rows...)
	cmd := func(args ...string) (int, string) {
		var out, errOut strings.Builder
		code := run(args, &out, &errOut)
		return code, out.String() + errOut.String()
	}
	code, out := cmd("poison", "list", "--limit", "3")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "3 shown of 7 under the filter; next page: the same command with --after-id 3")
	code, out = cmd("poison", "list", "--limit", "3", "--after-id", "6")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "1 shown, after id 6, of 7 under the filter")
	require.NotContains(t, out, "next page")

	code, out = cmd("poison", "list", "--filter", "correlation=corr-1")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "4 shown of 4 under the filter")
	code, out = cmd("poison", "list", "--filter", "message=m5")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "1 shown of 1")
	// The filters -h lists act too: a correlation id alone was refused.
	code, out = cmd("poison", "requeue", "--filter", "correlation=corr-1", "--dry-run")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "would requeue")

	t.Setenv("COLUMNS", "100")
	code, out = cmd("poison", "list", "--limit", "2")
	require.Equal(t, 0, code)
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		require.LessOrEqual(t, utf8.RuneCountInString(line), 100, "fits COLUMNS: %q", line)
	}

	code, out = cmd("poison", "list", "--limit", "1", "--json")
	require.Equal(t, 0, code, out)
	var recs []struct {
		Payload map[string]int             `json:"payload"`
		Headers map[string]json.RawMessage `json:"headers"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &recs), out)
	require.Equal(t, 1, recs[0].Payload["n"], "the payload is JSON, not a string holding JSON")
	var history []map[string]any
	require.NoError(t, json.Unmarshal(recs[0].Headers["ferry_error_history"], &history), "the error history is a JSON array")
	require.Equal(t, "first", history[0]["error"])
}

// The broker's queues are where messages wait when no consumer runs:
// status reads each queue of the route table (without declaring one),
// shows what is ready and who consumes it, and calls a queue with
// messages and no consumer out.
func TestStatusShowsQueuesWithoutConsumer(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	ctx := context.Background()
	schema := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	t.Setenv("FERRY_AMQP_URL", pipelinetest.AMQPURL())
	t.Setenv("FERRY_AMQP_NAMESPACE", pipelinetest.UniqueName("statusq_"))

	cfg, err := cli.LoadConfig()
	require.NoError(t, err)
	opts, err := exampleApp()
	require.NoError(t, err)
	opts.Migrate, opts.WithoutBroker = true, true
	migrated, err := app.New(ctx, cfg, opts)
	require.NoError(t, err)
	migrated.Close()

	// Before any consumer started, no queue exists: status declares none.
	var out, errOut strings.Builder
	require.Equal(t, 0, run([]string{"status", "--json", "--exit-code=false"}, &out, &errOut), errOut.String())
	var before struct {
		Queues      []struct{ Queue string } `json:"queues"`
		QueuesError string                   `json:"queues_error"`
	}
	require.NoError(t, json.Unmarshal([]byte(out.String()), &before))
	require.Empty(t, before.QueuesError)
	require.Empty(t, before.Queues)

	// The application declares its topology; a mail waits in its queue.
	opts.WithoutBroker = false
	a, err := app.New(ctx, cfg, opts)
	require.NoError(t, err)
	ferrytest.TeardownTopology(t, a.Topology())
	defer a.Close()
	stats, err := a.QueueStats(ctx)
	require.NoError(t, err)
	require.NotEmpty(t, stats, "the route table's queues are declared")
	conn, err := amqp.Dial(pipelinetest.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	confirm, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", stats[0].Queue, true, false, amqp.Publishing{Body: []byte(`{}`)})
	require.NoError(t, err)
	require.True(t, confirm.Wait())

	out.Reset()
	require.Equal(t, 3, run([]string{"status"}, &out, &errOut), errOut.String())
	require.Contains(t, out.String(), "broker queues:")
	require.Regexp(t, regexp.QuoteMeta(stats[0].Queue)+` +1 +0\n`, out.String())
	attention := out.String()[strings.Index(out.String(), "needs attention:"):]
	require.Contains(t, attention, "queue "+stats[0].Queue+": 1 message(s) ready and no consumer")

	out.Reset()
	require.Equal(t, 0, run([]string{"status", "--json", "--exit-code=false"}, &out, &errOut), errOut.String())
	var rep struct {
		Queues []struct {
			Queue     string `json:"queue"`
			Ready     int    `json:"ready"`
			Consumers int    `json:"consumers"`
		} `json:"queues"`
	}
	require.NoError(t, json.Unmarshal([]byte(out.String()), &rep))
	require.Len(t, rep.Queues, len(stats), "status reads the queues the application declared, and no other")
	require.Equal(t, 1, rep.Queues[0].Ready)
}

// The example's event types against the snapshot committed at the root
// (ferry-schemas.json), as a service's CI runs `ferry schema check`: a
// change to orders.ChargeRequested that would break stored events fails
// here until it comes as a new version with a step.
func TestTheExamplesEventTypesMatchTheirSnapshot(t *testing.T) {
	var out, errOut strings.Builder
	require.Equal(t, 0, run([]string{"schema", "check", "--file", "../../ferry-schemas.json"}, &out, &errOut), "%s%s", out.String(), errOut.String())
	require.Contains(t, out.String(), "stripe.charge v1")
	require.Contains(t, out.String(), "compatible")
}
