package backfill_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/adoption/backfill"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// users are the legacy rows: 25 sign-ups, 5 of them already welcomed.
func setup(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := pipelinetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE users (id int PRIMARY KEY, email text, welcomed boolean);
		INSERT INTO users SELECT g, 'u' || g || '@example.com', g <= 5 FROM generate_series(1, 25) g`)
	require.NoError(t, err)
	return pool
}

const query = `SELECT id AS aggregate_id, json_build_object('user_id', id) AS payload,
	json_build_object('tenant_id', 't1') AS headers FROM users WHERE NOT welcomed ORDER BY id`

func intents(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	return len(outboxRows(t, pool))
}

// outboxRows is every row of the test's outbox, in id order.
func outboxRows(t *testing.T, pool *pgxpool.Pool) []pgoutbox.Row {
	t.Helper()
	rows, err := pipelinetest.OutboxTable(t).Rows(context.Background(), pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	return rows
}

func TestDryRunWritesNothingAndApplyWritesEachIntentOnce(t *testing.T) {
	t.Parallel()
	pool := setup(t)
	ctx := context.Background()
	o := backfill.Options{Name: "welcome-2026-12", Topic: "mail.welcome", Query: query, Spread: 30 * time.Minute}

	dry, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), o)
	require.NoError(t, err)
	require.True(t, dry.DryRun)
	require.Equal(t, 20, dry.Rows)
	require.Equal(t, 20, dry.ToWrite)
	require.Len(t, dry.Samples, 3)
	require.JSONEq(t, `{"user_id": 6}`, string(dry.Samples[0].Payload))
	require.Equal(t, map[string]string{"tenant_id": "t1"}, dry.Samples[0].Headers)
	require.InDelta(t, (30 * time.Minute).Seconds(), dry.LastAt.Sub(*dry.FirstAt).Seconds(), 1)
	require.Zero(t, intents(t, pool), "a dry run writes nothing")

	o.Apply = true
	res, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), o)
	require.NoError(t, err)
	require.Equal(t, 20, res.Written)
	again, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), o)
	require.NoError(t, err)
	require.Zero(t, again.Written, "the same name writes no intent twice")
	require.Equal(t, 20, again.AlreadyWritten)
	require.Equal(t, 20, intents(t, pool))

	// --spread: available_at runs evenly across the window.
	rows := outboxRows(t, pool)
	first, last, times := rows[0].AvailableAt, rows[0].AvailableAt, map[time.Time]bool{}
	for _, r := range rows {
		first, last, times[r.AvailableAt] = minTime(first, r.AvailableAt), maxTime(last, r.AvailableAt), true
	}
	distinct := len(times)
	require.InDelta(t, (30 * time.Minute).Seconds(), last.Sub(first).Seconds(), 2)
	require.Equal(t, 20, distinct)
	tenant, name := rows[0].Headers["tenant_id"], rows[0].Headers["ferry_backfill"]
	require.Equal(t, "t1", tenant)
	require.Equal(t, "welcome-2026-12", name)
}

func TestInterruptedApplyResumesWithoutDoubles(t *testing.T) {
	t.Parallel()
	pool := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	o := backfill.Options{Name: "resume", Topic: "mail.welcome", Query: query, Apply: true, BatchSize: 6, Rate: 10,
		Progress: func(p backfill.Progress) { cancel() }} // interrupted after the first batch
	res, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), o)
	require.Error(t, err)
	require.True(t, errors.Is(err, context.Canceled), "%v", err)
	require.Equal(t, 6, res.Written)
	require.Equal(t, 6, intents(t, pool))

	o.Progress = nil
	res, err = backfill.Run(context.Background(), pool, pipelinetest.Outbox(t), o)
	require.NoError(t, err)
	require.Equal(t, 14, res.Written, "the rest, and only the rest")
	require.Equal(t, 6, res.AlreadyWritten)
	rows := outboxRows(t, pool)
	aggregates := map[string]bool{}
	for _, r := range rows {
		aggregates[r.AggregateID] = true
	}
	require.Len(t, rows, 20)
	require.Len(t, aggregates, 20)
}

func TestMaxAndBadQueriesAreRefusedBeforeAnyWrite(t *testing.T) {
	t.Parallel()
	pool := setup(t)
	ctx := context.Background()
	_, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), backfill.Options{Name: "n", Topic: "t", Query: query, Apply: true, Max: 10})
	require.ErrorIs(t, err, backfill.ErrTooMany)
	require.Contains(t, err.Error(), "20 rows")
	for q, want := range map[string]string{
		`SELECT id FROM users`: "aggregate_id and payload",
		`SELECT id AS aggregate_id, 'not json' AS payload FROM users`:                               "not JSON",
		`SELECT 1 AS aggregate_id, '{}'::jsonb AS payload FROM users`:                               "appears twice",
		`SELECT id AS aggregate_id, '{}'::jsonb AS payload, '{"a":1}'::jsonb AS headers FROM users`: "not a string",
		`DELETE FROM users RETURNING id AS aggregate_id, '{}'::jsonb AS payload`:                    "read-only",
	} {
		_, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), backfill.Options{Name: "n", Topic: "t", Query: q, Apply: true})
		require.ErrorContains(t, err, want, q)
	}
	require.Zero(t, intents(t, pool))
	var users int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM users`).Scan(&users))
	require.Equal(t, 25, users, "the query ran read-only")
	_, err = backfill.Run(ctx, pool, pipelinetest.Outbox(t), backfill.Options{Name: "n", Topic: "t", Query: query, Spread: time.Minute, Rate: 2})
	require.Error(t, err)
}

// The read-only guard holds under every protocol: with the simple protocol
// as the connection's default (PgBouncer URLs), a query of several
// statements could COMMIT the read-only transaction and write after it.
// Headers a consumer trusts are refused in the dry run, before any write.
func TestQueryRunsAsOneReadOnlyStatementUnderEveryProtocol(t *testing.T) {
	t.Parallel()
	pool := setup(t)
	ctx := context.Background()
	var schema string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
	cfg := pool.Config().Copy()
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	simple, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer simple.Close()
	for _, apply := range []bool{false, true} {
		_, err = backfill.Run(ctx, simple, pipelinetest.Outbox(t), backfill.Options{Name: "n", Topic: "t", Apply: apply,
			Query: `COMMIT; DELETE FROM users; SELECT id AS aggregate_id, '{}'::jsonb AS payload FROM users`})
		require.Error(t, err)
	}
	var users int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM users`).Scan(&users))
	require.Equal(t, 25, users, "nothing was deleted")

	// The outbox's own instructions too: a row's ferry_topic would send its
	// intent elsewhere than --topic, its ferry_delay elsewhen than --spread.
	for _, key := range []string{"ferry_message_id", "ferry_backfill", "x-delivery-count", pipeline.MetaTopic, pipeline.MetaDelay, pipeline.MetaDeliverAt} {
		_, err = backfill.Run(ctx, pool, pipelinetest.Outbox(t), backfill.Options{Name: "n", Topic: "t",
			Query: `SELECT id AS aggregate_id, '{}'::jsonb AS payload, json_build_object('` + key + `', 'x') AS headers FROM users`})
		require.ErrorIs(t, err, pipeline.ErrReservedMetadata, key)
	}
	for _, topic := range []string{pipeline.RetryTopic, "ferry.unrouted", "orders$v2"} {
		_, err = backfill.Run(ctx, pool, pipelinetest.Outbox(t), backfill.Options{Name: "n", Topic: topic, Query: query})
		require.ErrorIs(t, err, pipeline.ErrInvalidEvent, topic)
	}
	require.Zero(t, intents(t, pool))
}

type welcomeV2 struct {
	UserID int    `json:"user_id"`
	Email  string `json:"email"`
}

func (w welcomeV2) Validate() error {
	if w.Email == "" {
		return errors.New("email is required")
	}
	return nil
}

// With the topic's event type, the intents carry its current version and
// a row its handler would refuse stops the run before any write.
func TestBackfillWritesTheEventTypesCurrentVersionAndRefusesWhatItCannotRead(t *testing.T) {
	t.Parallel()
	pool := setup(t)
	ctx := context.Background()
	chain, err := evolve.New[welcomeV2]("mail.welcome", "2", evolve.Raw("1", "2", func(raw json.RawMessage) (json.RawMessage, error) { return raw, nil }))
	require.NoError(t, err)
	bad := backfill.Options{Name: "welcome-v2", Topic: "mail.welcome", Apply: true, Event: chain,
		Query: `SELECT id AS aggregate_id, json_build_object('user_id', id, 'email', CASE WHEN id = 17 THEN '' ELSE email END) AS payload FROM users WHERE NOT welcomed ORDER BY id`}
	_, err = backfill.Run(ctx, pool, pipelinetest.Outbox(t), bad)
	require.ErrorContains(t, err, "row 12 (aggregate 17): the payload is not an event its handler reads")
	require.ErrorContains(t, err, "email is required")
	require.Zero(t, intents(t, pool), "refused before any write")

	good := bad
	good.Query = `SELECT id AS aggregate_id, json_build_object('user_id', id, 'email', email) AS payload FROM users WHERE NOT welcomed ORDER BY id`
	res, err := backfill.Run(ctx, pool, pipelinetest.Outbox(t), good)
	require.NoError(t, err)
	require.Equal(t, 20, res.Written)
	versions := map[string]bool{}
	for _, r := range outboxRows(t, pool) {
		versions[r.Headers["schema_version"]] = true
	}
	require.Equal(t, map[string]bool{"2": true}, versions)
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
