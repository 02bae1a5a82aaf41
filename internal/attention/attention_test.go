package attention_test

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/internal/attention"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
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
			Held:        []pgheld.Partition{{Consumer: "billing.charge.p3", Since: since, MessageID: "m-1", Attempt: 4, LastError: "card \x1b[2J declined " + strings.Repeat("x", 500)}},
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

// One outage is one item with a count: every partition of a route held
// behind its provider, every queue left without consumers. Each item
// says its kind, target, count, since and what to do (ferry status
// --json prints them).
func TestOneOutageIsOneItemWithACount(t *testing.T) {
	early, late := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC), time.Date(2026, 12, 3, 10, 5, 0, 0, time.UTC)
	var held []pgheld.Partition
	for i, since := range []time.Time{late, early, late, late, late, late, late, late} {
		held = append(held, pgheld.Partition{Consumer: "payments.charge@" + string(rune('0'+i)), Since: since, MessageID: "m-" + string(rune('a'+i)), Attempt: 3, LastError: "provider 503"})
	}
	held = append(held, pgheld.Partition{Consumer: "mail.send@1", Since: late, MessageID: "m-z", Attempt: 2, LastError: "451 try later"})
	items := attention.Items(attention.State{
		Report: pgstatus.Report{RelaysAlive: 1, Held: held},
		Queues: []rabbit.QueueStat{{Queue: "a.q", Ready: 1}, {Queue: "b.q", Ready: 2}, {Queue: "c.q", Ready: 3}, {Queue: "d.q", Ready: 4}},
	})
	require.Len(t, items, 3, "%+v", items)
	require.Equal(t, "held_partitions", items[0].Kind)
	require.Equal(t, "payments.charge", items[0].Target)
	require.Equal(t, 8, items[0].Count)
	require.Equal(t, early, *items[0].Since, "since the oldest hold")
	require.Contains(t, items[0].Text, "8 ordered partitions of payments.charge held, the oldest since 2026-12-03T10:00:00Z behind message m-b")
	require.NotEmpty(t, items[0].Hint)
	require.Equal(t, "mail.send", items[1].Target)
	require.Equal(t, 1, items[1].Count)
	require.Equal(t, "queue_without_consumer", items[2].Kind)
	require.Equal(t, 4, items[2].Count)
	require.Contains(t, items[2].Text, "4 queues with 10 message(s) ready and no consumer (a.q, b.q, c.q and 1 more)")
}

// An outbox partition is flagged once it still holds rows a prune interval
// and an hour after its week passed retention: before that a prune may
// simply not have run yet; an empty or current partition never is.
func TestOutboxPartitionLateForRetention(t *testing.T) {
	at := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	week := func(name string, until time.Time, empty bool) pgweeks.Partition {
		return pgweeks.Partition{Name: name, Until: until, Empty: empty}
	}
	retention := 30 * 24 * time.Hour
	state := func(parts ...pgweeks.Partition) attention.State {
		return attention.State{Report: pgstatus.Report{At: at, RelaysAlive: 1, OutboxPartitions: parts}, Unrouted: new(int),
			OutboxRetention: retention, PruneInterval: time.Hour}
	}
	require.Empty(t, attention.List(state(week("outbox_p01", at.Add(-retention-90*time.Minute), false))), "a prune may not have run yet")
	require.Empty(t, attention.List(state(week("outbox_p01", at.Add(-retention-3*time.Hour), true))), "emptied")
	require.Empty(t, attention.List(state(pgweeks.Partition{Name: "outbox_p10", Current: true})))
	items := attention.Items(state(week("outbox_p01", at.Add(-retention-3*time.Hour), false), week("outbox_p02", at.Add(-retention-30*time.Hour), false)))
	require.Len(t, items, 1)
	require.Equal(t, "outbox_retention", items[0].Kind)
	require.Equal(t, 2, items[0].Count)
	require.Equal(t, at.Add(-30*time.Hour), *items[0].Since)
	require.Contains(t, items[0].Hint, "prune outbox")
	require.Empty(t, attention.List(attention.State{Report: pgstatus.Report{At: at, RelaysAlive: 1, OutboxPartitions: []pgweeks.Partition{week("outbox_p01", at.Add(-100*24*time.Hour), false)}}, Unrouted: new(int)}),
		"without a retention, not judged")
}

// The ledger's weeks are judged by the ledger's retention, on their own.
func TestLedgerPartitionLateForRetention(t *testing.T) {
	at := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	retention := 14 * 24 * time.Hour
	late := pgweeks.Partition{Name: "processed_messages_p03", Until: at.Add(-retention - 5*time.Hour)}
	state := attention.State{Report: pgstatus.Report{At: at, RelaysAlive: 1, LedgerPartitions: []pgweeks.Partition{late},
		OutboxPartitions: []pgweeks.Partition{{Name: "outbox_p03", Until: late.Until}}}, Unrouted: new(int),
		OutboxRetention: 30 * 24 * time.Hour, LedgerRetention: retention, PruneInterval: time.Hour}
	items := attention.Items(state)
	require.Len(t, items, 1, "the outbox's week is within its own retention")
	require.Equal(t, "ledger_retention", items[0].Kind)
	require.Equal(t, at.Add(-5*time.Hour), *items[0].Since)
	require.Contains(t, items[0].Hint, "prune ledger")
}

// Every kind of item links the runbook of the alert that pages for the
// same thing, and every such runbook is on the page.
func TestEveryItemHasARunbookOnThePage(t *testing.T) {
	page, err := os.ReadFile("../../docs/operations.md")
	require.NoError(t, err)
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(page), "\n") {
		if title, ok := strings.CutPrefix(line, "### Runbook: "); ok {
			anchors["runbook-"+strings.ToLower(title)] = true
		}
	}
	for kind, anchor := range attention.Runbooks() {
		require.True(t, anchors[anchor], "%s: no %q on docs/operations.md", kind, anchor)
	}
	src, err := os.ReadFile("attention.go")
	require.NoError(t, err)
	for _, m := range regexp.MustCompile(`Kind: "([a-z_]+)"`).FindAllStringSubmatch(string(src), -1) {
		require.Contains(t, attention.Runbooks(), m[1], "item kind %s has no runbook", m[1])
	}
}

// A paused route's consumers detach (nothing waits unacked past the
// broker's consumer_timeout): its queues, every partition of them, are the
// pause's item, not queues without a consumer; another route's still are.
func TestAPausedRoutesQueuesAreThePausesItem(t *testing.T) {
	at := time.Date(2026, 12, 7, 10, 0, 0, 0, time.UTC)
	items := attention.Items(attention.State{
		Report: pgstatus.Report{RelaysAlive: 1, Paused: []pgpause.Pause{{Handler: "payments.charge", At: at, By: "ops", Reason: "provider maintenance"}}},
		Queues: []rabbit.QueueStat{
			{Queue: "ns.payments.charge@0", Handler: "payments.charge@0", Ready: 5},
			{Queue: "ns.payments.charge@1", Handler: "payments.charge@1", Ready: 7},
			{Queue: "ns.mail.send", Handler: "mail.send", Ready: 3},
		},
	})
	require.Len(t, items, 2, "%+v", items)
	require.Equal(t, "paused_handler", items[0].Kind)
	require.Equal(t, "queue_without_consumer", items[1].Kind)
	require.Equal(t, 1, items[1].Count)
	require.Equal(t, "ns.mail.send", items[1].Target)
}
