//go:build !race

package rabbit_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// This file is left out of `go test -race`, as reconnect_test.go is:
// watermill-amqp v2.1.3's ConnectionWrapper swaps its connection on
// reconnect without a lock (connection.go:96 vs :105), and the test below
// asks the publisher whether it is connected while the connection comes
// back. CI runs it without -race (.ci/run).

// blackHoleToxics drop every byte both ways and keep the connections open.
var blackHoleToxics = []string{"upstream", "downstream"}

// behindToxiproxy returns cfg with its URL through a Toxiproxy proxy of
// the test's own, and the proxy.
func behindToxiproxy(t *testing.T, cfg rabbit.Config) (rabbit.Config, func(on bool)) {
	t.Helper()
	tp, err := pipelinetest.StartToxiproxy()
	require.NoError(t, err)
	t.Cleanup(func() { _ = tp.Close() })
	up, err := pipelinetest.Upstream(cfg.URL)
	require.NoError(t, err)
	proxy, err := tp.Proxy("rabbitmq", up)
	require.NoError(t, err)
	cfg.URL, err = pipelinetest.ThroughProxy(cfg.URL, proxy.Listen)
	require.NoError(t, err)
	return cfg, func(on bool) {
		for _, stream := range blackHoleToxics {
			if on {
				_, err := proxy.AddToxic("black-hole-"+stream, "timeout", stream, 1, map[string]any{"timeout": 0})
				require.NoError(t, err)
			} else {
				require.NoError(t, proxy.RemoveToxic("black-hole-"+stream))
			}
		}
	}
}

// A publisher behind a black hole (Toxiproxy drops every byte, the
// connection stays open) waits out its caller's deadline once; after that,
// until the broker answers again, a publish fails at once as the
// publisher's outage, and Reachable says so: a relay asking it holds
// nothing (its position) while the link is silent. Once the link is back
// (and the heartbeat has given the silent connection up), publishes go
// through again.
func TestAPublisherBehindABlackHoleFailsFastAfterItsFirstTimeout(t *testing.T) {
	cfg, blackHole := behindToxiproxy(t, pipelinetest.Rabbit(t))
	topo, err := rabbit.NewTopology(cfg)
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)
	conn, err := rabbit.Dial(topo.Config(), "ferry-black-hole-test", watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	pub, err := rabbit.NewBatchPublisher(conn, topo)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	publish := func(timeout time.Duration) (error, time.Duration) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		start := time.Now()
		errs := pub.PublishBatch(ctx, []rabbit.Outgoing{{Topic: "black.hole", Msg: message.NewMessage(watermill.NewUUID(), []byte(`{}`))}})
		return errs[0], time.Since(start)
	}
	err, _ = publish(5 * time.Second)
	require.NoError(t, err, "before the black hole")
	require.NoError(t, pub.Reachable())

	blackHole(true)
	err, took := publish(time.Second)
	require.Error(t, err, "a publish into a black hole was confirmed")
	require.GreaterOrEqual(t, took, time.Second, "the first publish waits its deadline out")
	require.Error(t, pub.Reachable(), "a silent broker is reachable")
	require.True(t, pipeline.IsInfrastructure(pub.Reachable()))
	for range 3 {
		err, took = publish(5 * time.Second)
		require.Error(t, err)
		require.True(t, pipeline.IsInfrastructure(err), "not the publisher's outage: %v", err)
		require.Less(t, took, 500*time.Millisecond, "a publish to a silent broker waited for it: %v", err)
	}

	blackHole(false)
	require.Eventually(t, func() bool { return pub.Reachable() == nil }, 30*time.Second, 100*time.Millisecond, "the publisher never found the broker again")
	err, _ = publish(5 * time.Second)
	require.NoError(t, err, "after the black hole")
}
