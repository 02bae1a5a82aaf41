package rabbit_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func TestMarshalerNeverRefusesADelivery(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	d := amqp.Delivery{
		MessageId: "from-property",
		Body:      []byte("x"),
		Headers: amqp.Table{
			"x-delivery-count": int64(3), // quorum queues add it; the stock marshaler fails here
			"flag":             true,
			"when":             now,
			"nested":           amqp.Table{"a": "b"},
			"nothing":          nil,
			"schema_version":   int32(1),
		},
	}
	msg, err := rabbit.Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, "from-property", msg.UUID, "without the uuid header the AMQP message-id is used")
	require.Equal(t, "3", msg.Metadata.Get("x-delivery-count"))
	require.Equal(t, "true", msg.Metadata.Get("flag"))
	require.Equal(t, "2026-12-02T10:00:00Z", msg.Metadata.Get("when"))
	require.JSONEq(t, `{"a":"b"}`, msg.Metadata.Get("nested"))
	require.Equal(t, "1", msg.Metadata.Get("schema_version"))

	out := message.NewMessage("42", []byte(`{}`))
	out.Metadata.Set("correlation_id", "c1")
	p, err := rabbit.Marshaler{}.Marshal(out)
	require.NoError(t, err)
	require.Equal(t, "42", p.MessageId)
	require.Equal(t, "c1", p.CorrelationId)
	require.Equal(t, uint8(amqp.Persistent), p.DeliveryMode)
	back, err := rabbit.Marshaler{}.Unmarshal(amqp.Delivery{Headers: p.Headers, Body: p.Body})
	require.NoError(t, err)
	require.Equal(t, "42", back.UUID)
	require.Equal(t, "c1", back.Metadata.Get("correlation_id"))
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, rabbit.Config{}.WithDefaults().Validate())
	err := rabbit.Config{URL: "http://x", QueueType: "stream", PublishChannels: -1, Prefetch: -1, DialTimeout: -1}.Validate()
	for _, want := range []string{"URL", "QueueType", "PublishChannels", "Prefetch", "DialTimeout"} {
		require.ErrorContains(t, err, want)
	}
}

// A message published to a topic nobody consumes yet is not dropped: the
// alternate exchange keeps it in ferry.unrouted.
func TestUnroutedMessagesAreKept(t *testing.T) {
	t.Parallel()
	topo, err := rabbit.NewTopology(pipelinetest.Rabbit(t))
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)
	conn, err := amqp.Dial(topo.Config().URL)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, topo.Declare(conn, rabbit.Binding{Topic: "has.consumer", Queue: "consumer"}))

	pub, err := wamqp.NewPublisher(topo.PublisherConfig(), watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish("no.consumer.yet", message.NewMessage("1", []byte(`{}`))))
	require.NoError(t, pub.Publish("has.consumer", message.NewMessage("2", []byte(`{}`))))

	require.Eventually(t, func() bool {
		n, err := rabbit.QueueDepth(conn, topo.QueueName(rabbit.UnroutedName))
		return err == nil && n == 1
	}, 10*time.Second, 20*time.Millisecond)
	n, err := rabbit.QueueDepth(conn, topo.QueueName("consumer"))
	require.NoError(t, err)
	require.Equal(t, 1, n)

	// Declaring again (a second process starting) is accepted: same arguments.
	require.NoError(t, topo.Declare(conn, rabbit.Binding{Topic: "has.consumer", Queue: "consumer"}))
	require.NoError(t, topo.Purge(conn))
}
