package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/adoption/backfill"
	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
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
	_, err := pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (topic, aggregate_id, payload, headers, dispatched_at, created_at, part)
		SELECT 'orders.placed', 'a' || g, '{}', '{}', now() - interval '40 days', now() - interval '40 days', ferry_outbox_part(now() - interval '40 days')
		FROM generate_series(1, 5) g`)
	require.NoError(t, err)

	var out bytes.Buffer
	err = cli.Prune{Target: pgretention.Ledger, Options: pgretention.Options{Table: testTable, OlderThan: time.Minute, BatchSize: 10}}.Run(ctx, pool, &out)
	var usage cli.UsageError
	require.ErrorAs(t, err, &usage, "the ledger must outlast redeliveries")
	require.NoError(t, cli.Prune{Target: pgretention.Outbox, Options: pgretention.Options{Table: testTable, OlderThan: 30 * 24 * time.Hour, BatchSize: 2, DryRun: true}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "would remove 5 row(s)")
	require.Contains(t, out.String(), "would empty 1 partition(s)")
	out.Reset()
	require.NoError(t, cli.Prune{Target: pgretention.Outbox, Options: pgretention.Options{Table: testTable, OlderThan: 30 * 24 * time.Hour, BatchSize: 2}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "removed 5 row(s)")

	// An action on the poison store shows in the audit.
	_, err = pool.Exec(ctx, `INSERT INTO poison_messages (message_id, topic, handler, payload, reason) VALUES ('m1', 't', 'h', '\x7b7d'::bytea, 'r')`)
	require.NoError(t, err)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	require.NoError(t, cli.PoisonAction{Action: "discard", Selector: pgpoison.Selector{All: true}, Actor: "ops@test"}.Run(ctx, store, &bytes.Buffer{}))
	out.Reset()
	require.NoError(t, cli.Audit{Limit: 10}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "poison.discard")
	require.Contains(t, out.String(), "ops@test")
	require.Error(t, cli.Audit{Limit: 0}.Run(ctx, pool, &out))

	// A legacy effect with no shadow intent: the report disagrees, exit 1.
	_, err = pool.Exec(ctx, `INSERT INTO `+shadow.Table+` (topic, aggregate_id) VALUES ('mail.welcome', 'u-1')`)
	require.NoError(t, err)
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
	_, err := pool.Exec(ctx, `INSERT INTO poison_messages (message_id, topic, handler, payload, reason) VALUES ('m1', 't', 'h', '\x7b7d'::bytea, 'r')`)
	require.NoError(t, err)
	var out bytes.Buffer
	err = cli.Status{Config: app.Config{AMQP: pipelinetest.Rabbit(t), Relay: pgoutbox.RelayConfig{Table: testTable}}, ExitCode: true, JSON: true}.Run(ctx, pool, &out)
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
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxSQL).Scan(&n))
	require.Zero(t, n, "a dry run writes nothing")
	opts.Apply = true
	out.Reset()
	require.NoError(t, cli.Backfill{Options: opts, Outbox: pgoutbox.Config{Table: testTable}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "wrote 4 intent(s)")
	out.Reset()
	require.NoError(t, cli.Backfill{Options: opts, Outbox: pgoutbox.Config{Table: testTable}}.Run(ctx, pool, &out))
	require.Contains(t, out.String(), "wrote 0 intent(s)")
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxSQL+` WHERE topic = 'mail.welcome'`).Scan(&n))
	require.Equal(t, 4, n)
}

// Old poison does not keep exit 3 forever: `status --acknowledge` records
// (in the audit log) that the store as it is was seen; its messages then
// need no human, and a message poisoned later does, named as new.
func TestAcknowledgedPoisonNeedsNoHumanUntilMoreComes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	poison := func(id string) {
		_, err := pool.Exec(ctx, `INSERT INTO poison_messages (message_id, topic, handler, payload, reason) VALUES ($1, 't', 'h', '\x7b7d'::bytea, 'r')`, id)
		require.NoError(t, err)
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
