package pgpoison_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgconn"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pipelinetest"
)

func poisoned(id, topic string, payload string) *message.Message {
	m := message.NewMessage(id, []byte(payload))
	m.Metadata.Set(wmw.ReasonForPoisonedKey, "boom")
	m.Metadata.Set(wmw.PoisonedTopicKey, topic)
	m.Metadata.Set(wmw.PoisonedHandlerKey, "h")
	m.Metadata.Set(pipeline.MetaAttempt, "4")
	m.Metadata.Set(pipeline.MetaCorrelationID, "corr")
	m.Metadata.Set(pipeline.MetaAggregateID, "agg-"+id)
	return m
}

func TestStoreRoundTrip(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	db := pgconn.SQLDB(pool)
	defer db.Close()
	pub, err := pgpoison.NewPublisher(db)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("ignored", poisoned("1", "a.topic", `{"ok":1}`), poisoned("2", "b.topic", "not json")))
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)

	all, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Len(t, all, 2)
	require.Equal(t, "boom", all[0].Reason)
	require.Equal(t, 4, all[0].Attempts)
	require.Equal(t, "corr", all[0].CorrelationID)
	require.Equal(t, "agg-1", all[0].AggregateID)
	depth, err := store.Depth(context.Background())
	require.NoError(t, err)
	require.Equal(t, map[string]int{"a.topic": 1, "b.topic": 1}, depth)

	res, err := store.Requeue(context.Background(), pgpoison.Selector{All: true}, false)
	require.NoError(t, err)
	require.Len(t, res.Requeued, 2, "payloads go back byte for byte, JSON or not")
	require.Empty(t, res.Skipped)

	var topic string
	var headers map[string]string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT topic, headers FROM outbox WHERE message_uuid = $1`, res.MessageIDs[0]).Scan(&topic, &headers))
	require.Equal(t, "a.topic", topic)
	require.Equal(t, "1", headers[pipeline.MetaMessageID], "the message keeps its id")
	require.NotContains(t, headers, pipeline.MetaAttempt, "the attempt count is reset")
	require.NotContains(t, headers, wmw.ReasonForPoisonedKey)
	require.Equal(t, "corr", headers[pipeline.MetaCorrelationID])

	var raw []byte
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT payload_raw FROM outbox WHERE topic = 'b.topic'`).Scan(&raw))
	require.Equal(t, all[1].Payload, raw, "the non-JSON payload is back in the outbox byte for byte")

	left, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Empty(t, left)
	require.Error(t, pgpoison.Selector{}.Validate())
	require.Error(t, pgpoison.Selector{All: true, Topic: "x"}.Validate())
}
