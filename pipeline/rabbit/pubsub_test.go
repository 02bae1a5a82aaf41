package rabbit_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// TestPubSub runs Watermill's universal Pub/Sub suite, unmodified, against
// Ferry as a Pub/Sub: Watermill's SQL publisher writing the outbox (each
// Publish its own transaction), the relay forwarding it to RabbitMQ, and
// rabbit.Subscriber consuming by topic and consumer group.
//
// Features, honestly:
//   - ConsumerGroups: every group has its own queue per topic.
//   - Persistent: outbox rows and durable queues survive the processes.
//   - GuaranteedOrder false: relays claim in parallel and retries move a row
//     back; Ferry's order is per aggregate, on ordered topics (tested in
//     the relay and ordering tests), not global. TestNoAck and
//     TestPublishSubscribeInOrder therefore skip themselves.
//   - ExactlyOnceDelivery false: delivery is at least once; Ferry's
//     consumers deduplicate with their ledger (middleware, not the Pub/Sub).
//   - NewSubscriberReceivesOldMessages false: a queue keeps what was routed
//     to it, not a log to replay (the suite skips that test).
//   - ContextPreserved false: a message's Go context does not cross the
//     outbox; correlation and trace ids do, as metadata.
//   - RestartServiceCommand nil here: restarting the shared broker would cut
//     every other test; TestPubSubReconnect runs the suite's TestReconnect
//     against a RabbitMQ node of its own instead.
func TestPubSub(t *testing.T) {
	newPubSub := ferryPubSub(t, pipelinetest.Rabbit(t))
	tests.TestPubSub(t, features(),
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "") },
		newPubSub,
	)
}

// TestPubSubManyInFlight runs the suite again with consumers holding many
// deliveries at once and acking them together (rabbit.Consumer with
// InFlight 16, as batch routes run it).
func TestPubSubManyInFlight(t *testing.T) {
	newPubSub := ferryPubSubInFlight(t, pipelinetest.Rabbit(t), 16)
	tests.TestPubSub(t, features(),
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "") },
		newPubSub,
	)
}

func features() tests.Features {
	return tests.Features{
		ConsumerGroups:      true,
		ExactlyOnceDelivery: false,
		GuaranteedOrder:     false,
		Persistent:          true,
	}
}

// ferryPubSub starts a relay on a fresh schema towards the broker of cfg
// and returns the suite's constructor: the outbox publisher and a subscriber
// of the group.
func ferryPubSub(t *testing.T, cfg rabbit.Config) func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
	return ferryPubSubInFlight(t, cfg, 1)
}

func ferryPubSubInFlight(t *testing.T, cfg rabbit.Config, inFlight int) func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
	pool := pipelinetest.Postgres(t)
	topo, err := rabbit.NewTopology(cfg)
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)

	conn, err := rabbit.Dial(topo.Config(), "ferry-pubsub-test", watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	pub, err := rabbit.NewBatchPublisher(conn, topo)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	// One relay for the whole suite, like a deployment's; rows that fail to
	// publish (the broker restarting) are tried again soon.
	relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{OrderedTopics: pub.OrderedTopics(), PollInterval: 20 * time.Millisecond, BatchSize: 500,
		Backoff: pipeline.Backoff{Initial: 100 * time.Millisecond, Max: time.Second}}, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	outbox, err := pgoutbox.New(pgoutbox.Config{Ordered: topo.Ordered}, nil)
	require.NoError(t, err)
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { _ = db.Close() })

	return func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		p, err := outbox.Publisher(db)
		require.NoError(t, err)
		s, err := rabbit.NewSubscriber(conn, topo, rabbit.SubscriberConfig{Group: group, InFlight: inFlight}, watermill.NopLogger{})
		require.NoError(t, err)
		return p, s
	}
}
