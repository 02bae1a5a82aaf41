package rabbit_test

import (
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func TestNodesShareAllButTheAddress(t *testing.T) {
	t.Parallel()
	require.Equal(t, []string{"amqp://u:p@a:5672/v", "amqp://u:p@b:5672/v"}, rabbit.Nodes(" amqp://u:p@a:5672/v , amqp://u:p@b:5672/v,"))
	require.NoError(t, rabbit.ValidateNodes("amqp://u:p@a:5672/v,amqp://u:p@b:5673/v"))
	for _, bad := range []string{"amqp://u:p@a/v,amqp://u:p@b/w", "amqp://u:p@a/v,amqp://x:p@b/v", "amqp://u:p@a/v,amqps://u:p@b/v", "amqp://u:p@a/v,http://b"} {
		require.Error(t, rabbit.ValidateNodes(bad), bad)
		require.Error(t, rabbit.Config{URL: bad}.Validate(), bad)
	}
	red := rabbit.RedactNodes("amqp://u:secret1@a/v,amqp://u:secret2@b/v")
	require.NotContains(t, red, "secret")
	require.Equal(t, 2, strings.Count(red, "amqp://"))
}

// A connection to a list of nodes dials the first; when that node is
// lost, the next dial — Watermill's reconnection calls amqp.DialConfig
// with the same configuration, so the same dialer — lands on the next one,
// and stays there while it lives. (Watched through amqp091 directly:
// Watermill's ConnectionWrapper.Connection is not safe to read while it
// reconnects.)
func TestConnectionFailsOverToTheNextNode(t *testing.T) {
	t.Parallel()
	n1, n2 := pipelinetest.OwnRabbit(t), pipelinetest.OwnRabbit(t)
	port := func(u string) string { return u[strings.LastIndex(u, ":")+1 : strings.LastIndex(u, "/")] }
	uri, conf := rabbit.AMQPConfig(rabbit.Config{URL: n1.Config.URL + "," + n2.Config.URL}, "ferry-test-failover")
	dial := func() *amqp.Connection {
		t.Helper()
		c, err := amqp.DialConfig(uri, conf)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	first := dial()
	require.True(t, strings.HasSuffix(first.RemoteAddr().String(), ":"+port(n1.Config.URL)), "the first node first: %s", first.RemoteAddr())
	lost := first.NotifyClose(make(chan *amqp.Error, 1))

	n1.Ctl(t, "stop_app")
	select {
	case <-lost:
	case <-time.After(30 * time.Second):
		t.Fatal("the connection to the stopped node never closed")
	}
	second := dial()
	require.True(t, strings.HasSuffix(second.RemoteAddr().String(), ":"+port(n2.Config.URL)), "the next node after the loss: %s", second.RemoteAddr())
	ch, err := second.Channel()
	require.NoError(t, err, "the new connection works")
	_, err = ch.QueueDeclare(pipelinetest.UniqueName("ferrytest.failover."), false, true, true, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.Close())

	n1.Ctl(t, "start_app")
	n1.Ctl(t, "await_startup")
	third := dial()
	require.True(t, strings.HasSuffix(third.RemoteAddr().String(), ":"+port(n2.Config.URL)), "a live node is kept, not moved back: %s", third.RemoteAddr())
}
