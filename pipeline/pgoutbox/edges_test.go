package pgoutbox_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// publishPath is one way a producer gets an event into the outbox. Each
// runs a business insert first and another after the publish call, in the
// same transaction, and commits if the publish succeeded: a refused event
// must leave the caller's transaction usable.
type publishPath struct {
	name string
	run  func(ctx context.Context, t *testing.T, ob *pgoutbox.Outbox, name, topic string, msg *message.Message) (publishErr error)
}

func publishPaths(t *testing.T) []publishPath {
	return []publishPath{
		{"PublishTx on database/sql", func(ctx context.Context, t *testing.T, ob *pgoutbox.Outbox, name, topic string, msg *message.Message) error {
			db := pgdb.SQLDB(poolOf(t, ctx))
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			_, err = tx.ExecContext(ctx, `INSERT INTO things (name) VALUES ($1)`, name+"-before")
			require.NoError(t, err)
			perr := ob.PublishTx(ctx, tx, topic, msg)
			_, err = tx.ExecContext(ctx, `INSERT INTO things (name) VALUES ($1)`, name+"-after")
			require.NoError(t, err, "the caller's transaction survives a refused event")
			require.NoError(t, tx.Commit())
			return perr
		}},
		{"InTx", func(ctx context.Context, t *testing.T, ob *pgoutbox.Outbox, name, topic string, msg *message.Message) error {
			var perr error
			err := ob.InTx(ctx, poolOf(t, ctx), func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
				if _, err := q.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, name+"-before"); err != nil {
					return err
				}
				perr = p.PublishEvents(ctx, pipeline.Outgoing{Topic: topic, Msg: msg})
				_, err := q.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, name+"-after")
				return err
			})
			require.NoError(t, err, "the caller's transaction survives a refused event")
			return perr
		}},
		{"PublishEventsTx on a pgx transaction", func(ctx context.Context, t *testing.T, ob *pgoutbox.Outbox, name, topic string, msg *message.Message) error {
			pool := poolOf(t, ctx)
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, name+"-before")
			require.NoError(t, err)
			perr := ob.PublishEventsTx(ctx, pgoutbox.PgxTx(tx), pipeline.Outgoing{Topic: topic, Msg: msg})
			_, err = tx.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, name+"-after")
			require.NoError(t, err, "the caller's transaction survives a refused event")
			require.NoError(t, tx.Commit(ctx))
			return perr
		}},
		{"Watermill Publisher", func(ctx context.Context, t *testing.T, ob *pgoutbox.Outbox, name, topic string, msg *message.Message) error {
			pool := poolOf(t, ctx)
			_, err := pool.Exec(ctx, `INSERT INTO things (name) VALUES ($1), ($2)`, name+"-before", name+"-after")
			require.NoError(t, err)
			pub, err := ob.Publisher(pgdb.SQLDB(pool))
			require.NoError(t, err)
			return pub.Publish(topic, msg)
		}},
	}
}

type poolKey struct{}

// poolOf reads the test's pool from ctx.
func poolOf(t *testing.T, ctx context.Context) *pgxpool.Pool {
	t.Helper()
	return ctx.Value(poolKey{}).(*pgxpool.Pool)
}

// A producer cannot set the metadata consumers trust, whichever way it
// publishes: the event is refused with ErrReservedMetadata before anything
// is written, and the caller's transaction goes on. The keys a producer
// may set (delays, the per-message topic) still work.
func TestProducersCannotSetReservedMetadata(t *testing.T) {
	t.Parallel()
	pool := thingsDB(t)
	ctx := context.WithValue(context.Background(), poolKey{}, pool)
	ob := pipelinetest.Outbox(t)
	reserved := []string{
		pipeline.MetaMessageID, pipeline.MetaOutboxID, pipeline.MetaAttempt, pipeline.MetaErrorHistory,
		pipeline.MetaRetryQueue, pipeline.MetaOriginalTopic, pipeline.MetaLastError, pipeline.MetaFirstFailedAt,
		"ferry_anything_new", pipeline.MetaOutboxAttempt, pipeline.MetaOutboxCreatedAt, pipeline.MetaPoisonedAt,
		"reason_poisoned", "_watermill_message_uuid", "x-delivery-count", "x-first-death-reason",
	}
	n := 0
	for _, path := range publishPaths(t) {
		for _, key := range reserved {
			n++
			name := fmt.Sprintf("r%d", n)
			msg := message.NewMessage(fmt.Sprintf("id-%d", n), []byte(`{"n":1}`))
			msg.Metadata.Set(key, "00000000-0000-0000-0000-000000000001")
			err := path.run(ctx, t, ob, name, "thing.made", msg)
			require.ErrorIs(t, err, pipeline.ErrReservedMetadata, "%s with %s", path.name, key)
			require.ErrorIs(t, err, pipeline.ErrInvalidEvent, "%s with %s", path.name, key)
			require.Contains(t, err.Error(), key)
		}
	}
	var things int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM things`).Scan(&things))
	require.Zero(t, countWhere(t, pool, ""), "no refused event was written")
	require.Equal(t, 2*n, things, "every caller's business writes committed")

	for i, path := range publishPaths(t) {
		msg := message.NewMessage(fmt.Sprintf("ok-%d", i), []byte(`{"n":1}`))
		pipeline.WithDelay(msg, 0)
		msg.Metadata.Set(pipeline.MetaTenantID, "acme")
		msg.Metadata.Set(pipeline.MetaBackfill, "label")
		require.NoError(t, path.run(ctx, t, ob, fmt.Sprintf("ok%d", i), "thing.made", msg), path.name)
	}
}

// Input the database would refuse is refused before the write, so it can
// never abort the caller's transaction: a NUL or invalid UTF-8 in any
// text, a topic RabbitMQ keeps for itself. A nil payload is an empty one.
func TestInvalidEventsNeverAbortTheCallersTransaction(t *testing.T) {
	t.Parallel()
	pool := thingsDB(t)
	ctx := context.WithValue(context.Background(), poolKey{}, pool)
	ob := pipelinetest.Outbox(t)
	type input struct {
		topic  string
		mutate func(*message.Message)
	}
	bad := map[string]input{
		"NUL in a header value":          {"thing.made", func(m *message.Message) { m.Metadata.Set("note", "a\x00b") }},
		"NUL in a header key":            {"thing.made", func(m *message.Message) { m.Metadata.Set("no\x00te", "x") }},
		"Latin-1 header":                 {"thing.made", func(m *message.Message) { m.Metadata.Set("note", "Kunde ung\xfcltig") }},
		"NUL in the aggregate id":        {"thing.made", func(m *message.Message) { m.Metadata.Set(pipeline.MetaAggregateID, "o\x001") }},
		"NUL in the UUID":                {"thing.made", func(m *message.Message) { m.UUID = "id\x00" }},
		"reserved topic":                 {"amq.invoices.created", func(*message.Message) {}},
		"control character in the topic": {"thing\x01made", func(*message.Message) {}},
		// Ferry's own topics: a producer's event there would fail at the
		// relay for ever, or reach no route.
		"Ferry's retry topic":           {pipeline.RetryTopic, func(*message.Message) {}},
		"Ferry's unrouted topic":        {"ferry.unrouted", func(*message.Message) {}},
		"a topic no route can consume":  {"orders$v2", func(*message.Message) {}},
		"a topic longer than a route's": {strings.Repeat("t", 230), func(*message.Message) {}},
		// Delays: bounded (a year by default), and one way at a time.
		"a delay of 292 years":  {"thing.made", func(m *message.Message) { m.Metadata.Set(pipeline.MetaDelay, "2562047h") }},
		"delivery in year 9999": {"thing.made", func(m *message.Message) { m.Metadata.Set(pipeline.MetaDeliverAt, "9999-12-31T00:00:00Z") }},
		"a delay and a time": {"thing.made", func(m *message.Message) {
			pipeline.WithDelay(m, time.Minute)
			pipeline.WithDeliverAt(m, time.Now().Add(time.Hour))
		}},
	}
	n := 0
	for _, path := range publishPaths(t) {
		for what, in := range bad {
			n++
			msg := message.NewMessage(fmt.Sprintf("bad-%d", n), []byte(`{"n":1}`))
			in.mutate(msg)
			err := path.run(ctx, t, ob, fmt.Sprintf("b%d", n), in.topic, msg)
			require.ErrorIs(t, err, pipeline.ErrInvalidEvent, "%s: %s", path.name, what)
		}
	}
	require.Zero(t, countWhere(t, pool, ""))

	for i, path := range publishPaths(t) {
		msg := message.NewMessage(fmt.Sprintf("nil-%d", i), nil)
		require.NoError(t, path.run(ctx, t, ob, fmt.Sprintf("nil%d", i), "thing.made", msg), "%s: a nil payload", path.name)
	}
	require.Equal(t, len(publishPaths(t)), countWhere(t, pool, "payload_raw = ''::bytea"), "a nil payload is stored as an empty one")
}

// A durable retry is Ferry's own write of a message that was delivered:
// it keeps its reserved metadata, and texts that came with the delivery
// (a provider's Latin-1 error, a NUL in a broker header) are stored
// cleaned rather than refused. A database that cannot take the row is
// infrastructure (the message waits), never the message's fault.
func TestReschedulerStoresDeliveredTextsAndWaitsOutTheDatabase(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	ob := pipelinetest.Outbox(t)
	rs, err := pgoutbox.NewRescheduler(pool, ob)
	require.NoError(t, err)
	require.NoError(t, rs.ScheduleRetry(ctx, pipeline.Retry{
		Payload: []byte(`{"n":1}`),
		Headers: map[string]string{
			pipeline.MetaMessageID: "m-1", pipeline.MetaRetryQueue: "billing.charge", pipeline.MetaAttempt: "2",
			pipeline.MetaLastError: "400: Kunde ung\xfcltig", "note": "a\x00b",
		},
	}))
	stored := rowWhere(t, pool, "")
	uuid, lastError, note, aggregate := stored.MessageUUID, stored.Headers["ferry_last_error"], stored.Headers["note"], stored.AggregateID
	require.Equal(t, "m-1", uuid, "the retry keeps the message's id as its UUID")
	require.Equal(t, "400: Kunde ung\uFFFDltig", lastError)
	require.Equal(t, "a\uFFFDb", note)
	require.Empty(t, aggregate, "the aggregate as delivered")

	u, err := url.Parse(pipelinetest.DatabaseURL())
	require.NoError(t, err)
	u.Path = "/" + pipelinetest.UniqueName("ferry_no_such_db_")
	gone, err := pgxpool.New(ctx, u.String())
	require.NoError(t, err)
	defer gone.Close()
	rs, err = pgoutbox.NewRescheduler(gone, ob)
	require.NoError(t, err)
	err = rs.ScheduleRetry(ctx, pipeline.Retry{Payload: []byte(`{}`), Headers: map[string]string{pipeline.MetaMessageID: "m-2", pipeline.MetaRetryQueue: "q"}})
	require.Error(t, err)
	require.True(t, pipeline.IsInfrastructure(err), "%v", err)
}
