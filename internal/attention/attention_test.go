package attention_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/internal/attention"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

func TestAllWellIsAnEmptyList(t *testing.T) {
	require.Empty(t, attention.List(attention.State{Report: pgstatus.Report{RelaysAlive: 1}, Unrouted: new(int)}))
}

// A queue is called out only when messages wait in it and nobody takes
// them; a held partition comes before the poison store (its aggregates
// are blocked now), and untrusted reasons are escaped and cut.
func TestWhereMessagesWait(t *testing.T) {
	since := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	got := attention.List(attention.State{
		Report: pgstatus.Report{
			RelaysAlive: 1,
			PoisonTotal: 2,
			Held:        []pgstatus.HeldPartition{{Consumer: "billing.charge.p3", Since: since, MessageID: "m-1", Attempt: 4, LastError: "card \x1b[2J declined " + strings.Repeat("x", 500)}},
		},
		Queues: []rabbit.QueueStat{
			{Queue: "mail.q", Ready: 70, Consumers: 0},
			{Queue: "busy.q", Ready: 9, Consumers: 2},
			{Queue: "idle.q", Ready: 0, Consumers: 0},
		},
		Command: "shop",
	})
	require.Len(t, got, 3, "%q", got)
	require.Contains(t, got[0], "ordered partition billing.charge.p3 held since 2026-12-03T10:00:00Z behind message m-1 (next attempt 4)")
	require.NotContains(t, got[0], "\x1b")
	require.Less(t, len(got[0]), 400, "the reason is cut")
	require.Equal(t, "queue mail.q: 70 message(s) ready and no consumer: start the consumers of its route (shop consume)", got[1])
	require.Equal(t, "2 message(s) in the poison store (shop poison list)", got[2])
}

func TestBrokerUnreachableComesFirst(t *testing.T) {
	got := attention.List(attention.State{Report: pgstatus.Report{PoisonTotal: 1}, BrokerError: "dial tcp 127.0.0.1:1: connection refused"})
	require.Len(t, got, 3)
	require.True(t, strings.HasPrefix(got[0], "RabbitMQ unreachable (dial tcp"), got[0])
	require.Equal(t, "no live relay: nothing is being dispatched", got[1])
}
