package rabbit_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/internal/pipelinetest"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
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

// A connection to a list of nodes dials the first and, when that node is
// lost, Watermill's reconnection lands on the next one: the dial, not the
// URL, picks the node.
func TestConnectionFailsOverToTheNextNode(t *testing.T) {
	t.Parallel()
	n1, n2 := pipelinetest.OwnRabbit(t), pipelinetest.OwnRabbit(t)
	port := func(u string) string { return u[strings.LastIndex(u, ":")+1 : strings.LastIndex(u, "/")] }
	cfg := rabbit.Config{URL: n1.Config.URL + "," + n2.Config.URL}
	conn, err := rabbit.Dial(cfg, "ferry-test-failover", watermill.NopLogger{})
	require.NoError(t, err)
	defer conn.Close()
	remote := func() string {
		c := conn.Connection()
		if c == nil || c.IsClosed() {
			return ""
		}
		return c.RemoteAddr().String()
	}
	require.True(t, strings.HasSuffix(remote(), ":"+port(n1.Config.URL)), "the first node first: %s", remote())

	n1.Ctl(t, "stop_app")
	defer n1.Ctl(t, "start_app")
	require.Eventually(t, func() bool { return strings.HasSuffix(remote(), ":"+port(n2.Config.URL)) }, 60*time.Second, 100*time.Millisecond,
		"the connection never moved to the second node (on %q)", remote())
	ch, err := conn.Connection().Channel()
	require.NoError(t, err, "the new connection works")
	_, err = ch.QueueDeclare(pipelinetest.UniqueName("ferrytest.failover."), false, true, true, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.Close())
}
