package rabbit_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// clashingTopic declares, behind Ferry's back, the exchange of a topic with
// another type: declaring it as Ferry does then makes RabbitMQ close the
// channel (406 PRECONDITION_FAILED), as a reserved "amq." name does (403).
func clashingTopic(t *testing.T, topo *rabbit.Topology, topic string) {
	t.Helper()
	conn, err := amqp.Dial(topo.Config().URL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDeclare(topo.ExchangeName(topic), "headers", false, false, false, false, nil))
	t.Cleanup(func() {
		conn, err := amqp.Dial(topo.Config().URL)
		require.NoError(t, err)
		defer conn.Close()
		ch, err := conn.Channel()
		require.NoError(t, err)
		require.NoError(t, ch.ExchangeDelete(topo.ExchangeName(topic), false, false))
	})
}

// clashRig is a connection and a publisher, closed when the test ends,
// over a topology whose topic "clash" the broker refuses.
func clashRig(t *testing.T) (*wamqp.ConnectionWrapper, *rabbit.BatchPublisher) {
	t.Helper()
	topo, err := rabbit.NewTopology(pipelinetest.Rabbit(t))
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)
	clashingTopic(t, topo, "clash")
	conn, err := rabbit.Dial(topo.Config(), "ferry-isolation-test", watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	pub, err := rabbit.NewBatchPublisher(conn, topo)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return conn, pub
}

// A message the broker refuses on a live connection is the message's
// failure; every message of a batch published while the connection is down
// is the publisher's outage (pipeline.Infrastructure), which the relay
// does not charge to the rows.
func TestAnOutageIsThePublishersAndARefusalTheMessages(t *testing.T) {
	t.Parallel()
	conn, pub := clashRig(t)

	errs := pub.PublishBatch(context.Background(), []pipeline.Outgoing{
		{Topic: "fine.one", Msg: message.NewMessage("ok-1", []byte(`{}`))},
		{Topic: "clash", Msg: message.NewMessage("bad", []byte(`{}`))},
	})
	require.NoError(t, errs[0])
	require.Error(t, errs[1])
	require.False(t, pipeline.IsInfrastructure(errs[1]), "a refusal on a live connection is the message's: %v", errs[1])

	require.NoError(t, conn.Close())
	errs = pub.PublishBatch(context.Background(), []pipeline.Outgoing{
		{Topic: "fine.one", Msg: message.NewMessage("down-1", []byte(`{}`))},
		{Topic: "fine.two", Msg: message.NewMessage("down-2", []byte(`{}`))},
	})
	for i, err := range errs {
		require.Error(t, err, i)
		require.True(t, pipeline.IsInfrastructure(err), "message %d, connection down: %v", i, err)
	}
}

// One message whose publish makes the broker close the channel is charged
// with the failure alone: the rest of its batch is delivered, before and
// after it, and the relay records the error on its row only.
func TestAChannelClosingMessageFailsAlone(t *testing.T) {
	t.Parallel()
	_, pub := clashRig(t)

	batch := []pipeline.Outgoing{
		{Topic: "fine.one", Msg: message.NewMessage("ok-1", []byte(`{}`))},
		{Topic: "clash", Msg: message.NewMessage("bad", []byte(`{}`))},
		{Topic: "fine.one", Msg: message.NewMessage("ok-2", []byte(`{}`))},
		{Topic: "fine.two", Msg: message.NewMessage("ok-3", []byte(`{}`))},
	}
	errs := pub.PublishBatch(context.Background(), batch)
	require.NoError(t, errs[0])
	require.Error(t, errs[1])
	require.Contains(t, errs[1].Error(), "406")
	require.NoError(t, errs[2])
	require.NoError(t, errs[3])

	// Through the relay: rows in the outbox (written before topic checks,
	// or clashing for another reason).
	pool := pipelinetest.Postgres(t)
	outbox := pipelinetest.Outbox(t)
	db := pgdb.SQLDB(pool)
	defer db.Close()
	tx, err := db.Begin()
	require.NoError(t, err)
	require.NoError(t, outbox.PublishEventsTx(context.Background(), tx,
		pipeline.Outgoing{Topic: "fine.one", Msg: message.NewMessage("r-1", []byte(`{}`))},
		pipeline.Outgoing{Topic: "clash", Msg: message.NewMessage("r-bad", []byte(`{}`))},
		pipeline.Outgoing{Topic: "fine.two", Msg: message.NewMessage("r-2", []byte(`{}`))},
	))
	require.NoError(t, tx.Commit())
	relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{OrderedTopics: pub.OrderedTopics()}, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	_, err = relay.RelayBatch(context.Background())
	require.NoError(t, err)
	rows, err := pgoutbox.Table{}.Rows(context.Background(), pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	got := map[string][3]any{}
	for _, r := range rows {
		got[r.MessageID] = [3]any{r.Dispatched, r.Attempts, r.LastError != ""}
	}
	// Sent at the first attempt: the relay's position passed them, and they
	// keep no state of their own (no attempt counted, no error).
	require.Equal(t, [3]any{true, 0, false}, got["r-1"], "dispatched at its first attempt, no error")
	require.Equal(t, [3]any{true, 0, false}, got["r-2"], "dispatched at its first attempt, no error")
	require.Equal(t, [3]any{false, 1, true}, got["r-bad"])
}
