package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/adoption/backfill"
	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// prune, audit and shadow report run without flags: their options are
// checked before anything changes, and each says what it did.
func TestPruneAuditAndShadowReportRunWithoutFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	// Written 40 days ago, into that week's partition.
	old := time.Now().Add(-40 * 24 * time.Hour)
	for g := 1; g <= 5; g++ {
		pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{Topic: "orders.placed", AggregateID: fmt.Sprint("a", g), CreatedAt: old, Dispatched: true, DispatchedAt: old})
	}

	var out bytes.Buffer
	err := cli.Prune{Target: pgretention.Ledger, Options: pgretention.Options{Table: testTable, OlderThan: time.Minute, BatchSize: 10}}.Run(ctx, pool, &out)
	var usage cli.UsageError
	require.ErrorAs(t, err, &usage, "the ledger must outlast redeliveries")
	require.NoError(t, cli.Prune{Target: pgretention.Outbox, Options: pgretention.Options{Table: testTable, OlderThan: 30 * 24 * time.Hour, BatchSize: 2, DryRun: true}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "would remove 5 row(s)")
	require.Contains(t, out.String(), "would empty 1 partition(s)")
	out.Reset()
	require.NoError(t, cli.Prune{Target: pgretention.Outbox, Options: pgretention.Options{Table: testTable, OlderThan: 30 * 24 * time.Hour, BatchSize: 2}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "removed 5 row(s)")

	// An action on the poison store shows in the audit.
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: "m1", Reason: "r"})
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	require.NoError(t, cli.PoisonAction{Action: "discard", Selector: pgpoison.Selector{All: true}, Actor: "ops@test"}.Run(ctx, store, &bytes.Buffer{}))
	out.Reset()
	require.NoError(t, cli.Audit{Limit: 10}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "poison.discard")
	require.Contains(t, out.String(), "ops@test")
	require.Error(t, cli.Audit{Limit: 0}.Run(ctx, pool, &out))

	// A legacy effect with no shadow intent: the report disagrees, exit 1.
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	require.NoError(t, shadow.RecordLegacy(ctx, db, "mail.welcome", "u-1"))
	out.Reset()
	err = cli.ShadowReport{Since: time.Hour, OutboxTable: testTable}.Run(ctx, pool, &out)
	var exit cli.ExitError
	require.True(t, errors.As(err, &exit) && exit.Code == 1, "%v", err)
	require.Contains(t, out.String(), "MISMATCH")
}

// status runs without flags: on a service with no live relay and a
// poisoned message it prints the report and ends with ExitAttention, with
// each thing that needs a human listed.
func TestStatusRunsWithoutFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: "m1", Reason: "r"})
	var out bytes.Buffer
	err := cli.Status{Config: app.Config{AMQP: pipelinetest.Rabbit(t), Relay: pgoutbox.RelayConfig{Table: testTable}}, ExitCode: true, JSON: true}.Run(ctx, pool, &out)
	var exit cli.ExitError
	require.True(t, errors.As(err, &exit) && exit.Code == cli.ExitAttention, "%v", err)
	var rep struct {
		PoisonTotal int      `json:"poison_total"`
		Attention   []string `json:"attention"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &rep), out.String())
	require.Equal(t, 1, rep.PoisonTotal)
	require.NotEmpty(t, rep.Attention)
	require.Error(t, cli.Status{Attempts: -1}.Run(ctx, pool, &out))
}

// migrate runs without flags: status lists Ferry's migrations as applied
// on a migrated schema, and an unknown verb is a usage error.
func TestMigrateRunsWithoutFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	var out bytes.Buffer
	require.NoError(t, cli.Migrate{Verb: "status", Sets: []migrations.Set{migrations.Library}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "applied")
	require.NotContains(t, out.String(), "pending")
	var usage cli.UsageError
	require.ErrorAs(t, cli.Migrate{Verb: "sideways", Sets: []migrations.Set{migrations.Library}}.Run(ctx, pool, &out), &usage)
}

// backfill runs without flags: a dry run counts the rows its query returns
// and writes nothing; --apply writes them once, and a second run of the
// same name writes none again.
func TestBackfillRunsWithoutFlags(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	_, err := pool.Exec(ctx, `CREATE TABLE legacy_orders (id text); INSERT INTO legacy_orders SELECT 'o-' || g FROM generate_series(1, 4) g`)
	require.NoError(t, err)
	opts := backfill.Options{Name: "welcome-mails", Topic: "mail.welcome", Query: `SELECT id AS aggregate_id, json_build_object('order', id) AS payload FROM legacy_orders`, Max: 100}
	var out bytes.Buffer
	require.NoError(t, cli.Backfill{Options: opts, Outbox: pgoutbox.Config{Table: testTable}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "would write 4 intent(s)")
	count := func(f pgoutbox.RowFilter) int {
		rows, err := testTable.Rows(ctx, pool, f)
		require.NoError(t, err)
		return len(rows)
	}
	require.Zero(t, count(pgoutbox.RowFilter{}), "a dry run writes nothing")
	opts.Apply = true
	out.Reset()
	require.NoError(t, cli.Backfill{Options: opts, Outbox: pgoutbox.Config{Table: testTable}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "wrote 4 intent(s)")
	out.Reset()
	require.NoError(t, cli.Backfill{Options: opts, Outbox: pgoutbox.Config{Table: testTable}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "wrote 0 intent(s)")
	require.Equal(t, 4, count(pgoutbox.RowFilter{Topic: "mail.welcome"}))
}

// Old poison does not keep exit 3 forever: `status --acknowledge` records
// (in the audit log) that the store as it is was seen; its messages then
// need no human, and a message poisoned later does, named as new.
func TestAcknowledgedPoisonNeedsNoHumanUntilMoreComes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	poison := func(id string) {
		pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: id, Reason: "r"})
	}
	type item struct {
		Kind  string `json:"kind"`
		Count int    `json:"count"`
		Text  string `json:"text"`
	}
	status := func(ack bool) (items []item, newPoison int) {
		var out bytes.Buffer
		_ = cli.Status{Config: app.Config{AMQP: pipelinetest.Rabbit(t), Relay: pgoutbox.RelayConfig{Table: testTable}}, JSON: true, Acknowledge: ack, Actor: "ops@example.com"}.Run(ctx, pool, &out)
		var rep struct {
			Items     []item `json:"attention_items"`
			PoisonNew int    `json:"poison_new"`
		}
		require.NoError(t, json.Unmarshal(out.Bytes(), &rep), out.String())
		for _, it := range rep.Items {
			if it.Kind == "poison" {
				items = append(items, it)
			}
		}
		return items, rep.PoisonNew
	}
	poison("m1")
	poison("m2")
	got, n := status(false)
	require.Len(t, got, 1)
	require.Equal(t, 2, got[0].Count)
	require.Equal(t, 2, n)

	got, n = status(true)
	require.Empty(t, got, "acknowledged: the poison store no longer needs a human")
	require.Zero(t, n)
	entries, err := pgaudit.List(ctx, pool, 5)
	require.NoError(t, err)
	require.Equal(t, "status.acknowledge", entries[0].Action)
	require.Equal(t, "ops@example.com", entries[0].Actor)

	poison("m3")
	got, n = status(false)
	require.Len(t, got, 1)
	require.Equal(t, 1, got[0].Count)
	require.Equal(t, 1, n)
	require.Contains(t, got[0].Text, "1 new message(s) in the poison store since ops@example.com acknowledged it")
	require.Contains(t, got[0].Text, "(3 in all;")
}

// held list and held retry-now are the console's held partitions and its
// Retry now, one partition or a whole route's, from the command line.
func TestHeldListAndRetryNow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	store := pgheld.Store{Pool: pool}
	for _, c := range []string{"ledger.post@0", "ledger.post@1", "mail.send@0"} {
		require.NoError(t, store.Held(ctx, c, "m-"+c, 3, time.Now().Add(-time.Minute), time.Now().Add(time.Minute), "ledger answered 503"))
	}
	var out bytes.Buffer
	require.NoError(t, cli.HeldList{Route: "ledger.post"}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "ledger.post@0")
	require.Contains(t, out.String(), "ledger.post@1")
	require.NotContains(t, out.String(), "mail.send@0")
	out.Reset()
	require.NoError(t, cli.HeldRetry{Route: "ledger.post", Actor: "ops@test"}.Run(ctx, pool, &out))
	require.Equal(t, 2, strings.Count(out.String(), "asked "))
	out.Reset()
	require.NoError(t, cli.HeldRetry{Partition: "mail.send@0", Actor: "ops@test"}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "asked mail.send@0")
	for _, c := range []string{"ledger.post@0", "ledger.post@1", "mail.send@0"} {
		asked, err := store.RetryRequested(ctx, c, "m-"+c)
		require.NoError(t, err)
		require.True(t, asked, c)
	}
	require.Error(t, cli.HeldRetry{Partition: "nobody@0", Actor: "ops@test"}.Run(ctx, pool, &out), "not held")
	require.Len(t, pipelinetest.Audited(t, pool, pgheld.RetryNowAction), 2)
}
