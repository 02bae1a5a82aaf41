//go:build !race

package rabbit_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// This file is left out of `go test -race`: Watermill's TestReconnect
// appends to its publishedMessages slice in one goroutine and reads it in
// another without synchronisation (pubsub/tests/test_pubsub.go:1086 vs
// :1120, watermill v1.5.1), and watermill-amqp v2.1.3's ConnectionWrapper
// swaps its connection on reconnect without a lock (connection.go:114 vs
// :139); the race detector fails the test for either, whatever Ferry does.
// CI runs it without -race (.ci/run), where it checks what it is for:
// every message arrives across two broker restarts.

// TestPubSubReconnect is the suite's TestReconnect, against a RabbitMQ node
// of the test's own (the shared broker is not restarted under the other
// tests): 10,000 messages through outbox, relay and subscriber while the
// node is restarted twice.
func TestPubSubReconnect(t *testing.T) {
	node := pipelinetest.OwnRabbit(t)
	newPubSub := ferryPubSub(t, node.Config)
	f := features()
	f.RestartServiceCommand = node.Restart
	tests.TestReconnect(t, tests.TestContext{TestID: tests.NewTestID(), Features: f},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, "") })
	// The suite starts its two restarts in the background and may return
	// before the second is done: let it finish before the cleanups tear
	// the topology down and stop the node.
	node.AwaitRestarts(t, 2, 2*time.Minute)
}
