package pgstatus_test

import (
	"cmp"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A message at the broker that a route has not handled, looked up by its
// own id, says what keeps it there: its route is paused (by whom, why,
// how to end it), or its partition of an ordered route is held behind
// another aggregate's failing head that shares the partition. A message
// in a partition not held, or already handled by the paused route, says
// no such thing; neither does one once the pause ends.
func TestFindNamesThePauseOrHoldAMessageWaitsBehind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	const partitions = 8
	require.NoError(t, pgstatus.RegisterRoutes(ctx, pool, []pgstatus.Route{
		{Route: "ledger.post", Topic: "ledger.posted", Ordered: true, Partitions: partitions},
		{Route: "notifications.sms", Topic: "sms.send", Partitions: 1},
	}))
	// Another aggregate in the head's partition, and one in another.
	headAgg := "acct-1"
	k := pipeline.PartitionOf(headAgg, partitions)
	var sharing, elsewhere string
	for i := 2; sharing == "" || elsewhere == ""; i++ {
		a := fmt.Sprintf("acct-%d", i)
		if pipeline.PartitionOf(a, partitions) == k {
			sharing = cmp.Or(sharing, a)
		} else {
			elsewhere = cmp.Or(elsewhere, a)
		}
	}
	sent := func(uuid, topic, agg string) pipelinetest.OutboxRow {
		return pipelinetest.OutboxRow{MessageUUID: uuid, AggregateID: agg, Topic: topic, Dispatched: true, CreatedAt: time.Now().Add(-time.Minute)}
	}
	pipelinetest.InsertOutbox(t, pool, testTable,
		sent("m-head", "ledger.posted", headAgg),
		sent("m-behind", "ledger.posted", sharing),
		sent("m-free", "ledger.posted", elsewhere),
		sent("m-sms", "sms.send", "u-1"),
		sent("m-sms-done", "sms.send", "u-2"))
	pipelinetest.InsertLedger(t, pool, pipelinetest.LedgerRow{Consumer: "notifications.sms", MessageID: "m-sms-done"})
	part := pipeline.PartitionName("ledger.post", k)
	require.NoError(t, pgheld.Store{Pool: pool}.Held(ctx, part, "m-head", 3, time.Now().Add(-2*time.Minute), time.Now().Add(time.Minute), "ledger answered 503"))
	require.NoError(t, pgpause.Set(ctx, pool, "notifications.sms", "ops@example.com", "provider incident"))

	find := func(id string) pgstatus.Trail {
		t.Helper()
		found, err := pgstatus.Find(ctx, pool, testTable, nil, id, 10)
		require.NoError(t, err)
		require.Len(t, found.Trails, 1, id)
		return found.Trails[0]
	}
	behind := find("m-behind")
	require.Contains(t, behind.Now, "waiting at the broker behind the held head m-head of partition "+part)
	require.Contains(t, behind.Now, "ledger answered 503")
	require.Contains(t, behind.Now, "ferry held retry-now --route ledger.post")
	require.Equal(t, []pgstatus.Wait{{Route: "ledger.post", Kind: "held", Partition: part, HeadMessageID: "m-head",
		Since: behind.WaitingBehind[0].Since, Reason: "ledger answered 503"}}, behind.WaitingBehind)

	require.Contains(t, find("m-head").Now, "holding its partition", "the head itself is the hold, not behind it")
	free := find("m-free")
	require.Contains(t, free.Now, "at the broker or being handled")
	require.Empty(t, free.WaitingBehind)

	sms := find("m-sms")
	require.Contains(t, sms.Now, "waiting at the broker for notifications.sms, paused since")
	require.Contains(t, sms.Now, "by ops@example.com (provider incident; ferry resume notifications.sms ends it)")
	require.Equal(t, "handled by notifications.sms", find("m-sms-done").Now)

	require.NoError(t, pgpause.Clear(ctx, pool, "notifications.sms", "ops@example.com"))
	require.Contains(t, find("m-sms").Now, "at the broker or being handled")
}

// intent_status's reading (Intents) tells the same waits of an intent at
// the broker: the pause of a handler that has not handled it; nothing for
// one handled, or one whose handler keeps a durable retry of it.
func TestIntentsSayWhatTheyWaitBehind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	require.NoError(t, pgstatus.RegisterRoutes(ctx, pool, []pgstatus.Route{
		{Route: "notifications.sms", Topic: "sms.send", Partitions: 1},
		{Route: "audit.sms", Topic: "sms.send", Partitions: 1},
	}))
	pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{MessageUUID: "i-1", AggregateID: "order-1", Topic: "sms.send", Dispatched: true},
		pipelinetest.OutboxRow{MessageUUID: "i-2", AggregateID: "order-1", Topic: "sms.send", Dispatched: true})
	pipelinetest.InsertLedger(t, pool, pipelinetest.LedgerRow{Consumer: "notifications.sms", MessageID: "i-2"})
	require.NoError(t, pgpause.Set(ctx, pool, "notifications.sms", "ops@example.com", "provider incident"))

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // read-only
	intents, _, err := pgstatus.Intents(ctx, tx, testTable, "order-1", nil, 10)
	require.NoError(t, err)
	require.Len(t, intents, 2)
	require.Len(t, intents[0].WaitingBehind, 1)
	require.Equal(t, "notifications.sms", intents[0].WaitingBehind[0].Route)
	require.Equal(t, "paused", intents[0].WaitingBehind[0].Kind)
	require.Equal(t, "provider incident", intents[0].WaitingBehind[0].Reason)
	require.Empty(t, intents[1].WaitingBehind, "handled by the paused handler before the pause; audit.sms is not paused")
}
