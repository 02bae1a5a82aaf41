package pgoutbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// publish writes msgs to the outbox in one committed transaction.
func publish(t *testing.T, pool *pgxpool.Pool, topic string, msgs ...*message.Message) {
	t.Helper()
	db := pgdb.SQLDB(pool)
	tx, err := db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	require.NoError(t, pipelinetest.Outbox(t).PublishTx(context.Background(), tx, topic, msgs...))
	require.NoError(t, tx.Commit())
}

func event(t *testing.T, aggregate string, payload any) *message.Message {
	t.Helper()
	msg, err := pipeline.NewEvent(context.Background(), aggregate, payload)
	require.NoError(t, err)
	return msg
}

func TestPublishTxWritesOperationalColumns(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := pipeline.ContextWithCorrelationID(context.Background(), "corr-42")
	ctx = pipeline.ContextWithTenantID(ctx, "acme")
	msg, err := pipeline.NewEvent(ctx, "order-1", map[string]any{"amount": 100})
	require.NoError(t, err)
	publish(t, pool, "stripe.charge", msg)

	r := rowWhere(t, pool, "")
	require.Equal(t, "order-1", r.AggregateID)
	require.Equal(t, "stripe.charge", r.Topic)
	require.JSONEq(t, `{"amount":100}`, r.Payload)
	h := r.Headers
	require.Equal(t, "corr-42", h[pipeline.MetaCorrelationID])
	require.Equal(t, "acme", h[pipeline.MetaTenantID])
	require.Equal(t, "1", h[pipeline.MetaSchemaVersion])
	require.NotContains(t, h, pipeline.MetaAggregateID, "the aggregate id has its own column")
	require.Zero(t, r.Attempts)
	require.Nil(t, r.DispatchedAt)
	require.Empty(t, r.LastError)
	require.WithinDuration(t, r.CreatedAt, r.AvailableAt, time.Second, "no delay: due at once")
}

func TestPublishTxRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	tx, err := db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	require.NoError(t, pipelinetest.Outbox(t).PublishTx(context.Background(), tx, "t", event(t, "a", 1)))
	require.NoError(t, tx.Rollback())
	require.Zero(t, countWhere(t, pool, ""))
}

func TestPublishTxDelay(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	at := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	publish(t, pool, "mail.send",
		pipeline.WithDelay(event(t, "u1", "welcome"), 3*time.Minute),
		pipeline.WithDeliverAt(event(t, "u2", "later"), at))

	var got []string
	for _, r := range rowsWhere(t, pool, "") {
		agg, delay, avail, headers := r.AggregateID, r.AvailableAt.Sub(r.CreatedAt), r.AvailableAt, r.Headers
		require.NotContains(t, headers, pipeline.MetaDelay)
		require.NotContains(t, headers, pipeline.MetaDeliverAt)
		switch agg {
		case "u1":
			require.InDelta(t, (3 * time.Minute).Seconds(), delay.Seconds(), 1)
		case "u2":
			require.True(t, avail.Equal(at), "deliver-at %s stored as %s", at, avail)
		}
		got = append(got, agg)
	}
	require.Equal(t, []string{"u1", "u2"}, got)
}

func TestPublishTxRejectsBadInputBeforeWriting(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	good := event(t, "a", 1)
	noAggregate := event(t, "a", 1)
	noAggregate.Metadata.Set(pipeline.MetaAggregateID, "")
	noUUID := event(t, "a", 1)
	noUUID.UUID = ""
	badDelay := event(t, "a", 1)
	badDelay.Metadata.Set(pipeline.MetaDelay, "soon")
	negDelay := event(t, "a", 1)
	negDelay.Metadata.Set(pipeline.MetaDelay, "-1s")
	badUTF8 := event(t, "a", 1)
	badUTF8.Metadata.Set("tenant_id", "\xff")
	huge := event(t, "a", 1)
	huge.Payload = []byte(`"` + string(make([]byte, pgoutbox.MaxPayloadBytes)) + `"`)

	cases := map[string]struct {
		topic string
		msg   *message.Message
		want  string
	}{
		"missing aggregate on an ordered topic": {"t", noAggregate, "aggregate_id"},
		"no message UUID":                       {"t", noUUID, "UUID"},
		"bad delay":                             {"t", badDelay, "ferry_delay"},
		"negative delay":                        {"t", negDelay, "ferry_delay"},
		"invalid UTF-8":                         {"t", badUTF8, "UTF-8"},
		"huge payload":                          {"t", huge, "bytes"},
		"empty topic":                           {"", event(t, "a", 1), "topic"},
	}
	db := pgdb.SQLDB(pool)
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			tx, err := db.BeginTx(context.Background(), nil)
			require.NoError(t, err)
			defer tx.Rollback()
			// The good message first: a bad one in the same call must still
			// leave nothing behind.
			ob, err := pgoutbox.New(pgoutbox.Config{Table: testTable, Ordered: func(topic string) bool { return topic == "t" }}, nil)
			require.NoError(t, err)
			err = ob.PublishTx(context.Background(), tx, tc.topic, good, tc.msg)
			require.ErrorContains(t, err, tc.want)
			if tc.topic != "" {
				require.ErrorIs(t, err, pipeline.ErrInvalidEvent)
			}
			var n int
			require.NoError(t, tx.QueryRow(`SELECT count(*) FROM `+outboxSQL).Scan(&n))
			require.Zero(t, n)
		})
	}
}

func TestPublishEventsTxWritesManyTopicsInOneCall(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	tx, err := db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	ob := pipelinetest.Outbox(t)
	require.NoError(t, ob.PublishEventsTx(context.Background(), tx,
		pipeline.Outgoing{Topic: "stripe.charge", Msg: event(t, "o1", 1)},
		pipeline.Outgoing{Topic: "mail.send", Msg: event(t, "o1", 2)}))
	require.ErrorIs(t, ob.PublishEventsTx(context.Background(), tx, pipeline.Outgoing{Topic: "", Msg: event(t, "o1", 3)}), pipeline.ErrInvalidEvent)
	require.NoError(t, tx.Commit())

	var topics []string
	for _, r := range rowsWhere(t, pool, "") {
		require.NotContains(t, r.Headers, pipeline.MetaTopic)
		topics = append(topics, r.Topic)
	}
	require.Equal(t, []string{"stripe.charge", "mail.send"}, topics)
}

// Publish is NewEvent and PublishTx in one call, on a pgx transaction and
// on InTx's Pending: the event commits with the transaction, carries its
// aggregate and JSON payload, and what NewEvent or PublishTx refuses is
// refused before anything is written.
func TestPublishWritesOneEventInTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	ob, err := pgoutbox.New(pgoutbox.Config{Table: testTable, Ordered: func(topic string) bool { return topic == "ordered" }}, nil)
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return ob.Publish(ctx, tx, "invoice.issued", "inv-1", map[string]int{"amount": 5})
	}))
	require.NoError(t, ob.InTx(ctx, pool, func(ctx context.Context, _ pgoutbox.Querier, p *pgoutbox.Pending) error {
		return p.Publish(ctx, "invoice.sent", "inv-1", map[string]int{"amount": 5})
	}))
	rows, err := testTable.Rows(ctx, pool, pgoutbox.RowFilter{AggregateID: "inv-1"})
	require.NoError(t, err)
	require.Len(t, rows, 2)
	require.Equal(t, "invoice.issued", rows[0].Topic)
	require.Equal(t, "invoice.sent", rows[1].Topic)
	require.JSONEq(t, `{"amount":5}`, string(rows[0].Payload))

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return ob.Publish(ctx, tx, "ordered", "", map[string]int{"amount": 5})
	})
	require.Error(t, err, "an ordered topic needs an aggregate")
	require.Error(t, ob.Publish(ctx, nil, "invoice.issued", "inv-2", nil), "no transaction")
	rows, err = testTable.Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	require.Len(t, rows, 2, "nothing written by the refused calls")
}
