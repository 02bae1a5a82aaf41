package pgstatus_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// "Where is this message?" across every store: one order's messages, each
// in another place (in the outbox, handled, retrying, holding its
// partition, poisoned, discarded), found by the order's id, by a message
// id and by a correlation id, each with where it is now and its trail.
func TestFindSaysWhereEachMessageIs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	sent := func(uuid, topic string, ago time.Duration) pipelinetest.OutboxRow {
		at := time.Now().Add(-ago)
		return pipelinetest.OutboxRow{MessageUUID: uuid, AggregateID: "order-7", Topic: topic, CreatedAt: at, Dispatched: true, DispatchedAt: at}
	}
	pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{MessageUUID: "m-pending", AggregateID: "order-7", Topic: "orders.placed", Headers: map[string]string{"correlation_id": "corr-7", "trace_id": "trace-7"}},
		withHeaders(sent("m-handled", "orders.paid", 5*time.Minute), map[string]string{"correlation_id": "corr-7"}),
		sent("m-retry", "mail.send", 4*time.Minute),
		sent("m-held", "ledger.post", 3*time.Minute),
		sent("m-poison", "stripe.charge", 2*time.Minute),
		sent("m-broker", "sms.send", time.Minute),
		sent("m-behind", "ledger.post", 30*time.Second),
		pipelinetest.OutboxRow{MessageUUID: "m-other", AggregateID: "order-8", Topic: "orders.placed"},
		pipelinetest.OutboxRow{MessageUUID: "r-1", AggregateID: "order-7", Topic: pipeline.RetryTopic, AvailableAt: time.Now().Add(2 * time.Minute),
			Headers: map[string]string{"ferry_message_id": "m-retry", "ferry_retry_queue": "notifications.mail", "ferry_attempt": "3", "ferry_last_error": "SMTP 451 try later"}})
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: "m-poison", Topic: "stripe.charge", Handler: "payments.charge", AggregateID: "order-7",
		Reason: "card declined", CorrelationID: "corr-7"})
	pipelinetest.InsertLedger(t, pool, pipelinetest.LedgerRow{Consumer: "billing.paid", MessageID: "m-handled"})
	require.NoError(t, pgheld.Store{Pool: pool}.Held(ctx, "ledger.post@3", "m-held", 4, time.Now(), time.Now().Add(time.Minute), "ledger answered 503"))
	_, err := pool.Exec(ctx, `
		INSERT INTO ferry_poison_archive (id, message_id, topic, handler, consumer, aggregate_id, payload, headers, reason, permanent, attempts,
		  first_failed_at, last_failed_at, poisoned_at, correlation_id, discarded_by, discard_run) VALUES
		  (999, 'm-discarded', 'push.send', 'push', 'push', 'order-7', '\x7b7d', '{}', 'no device', true, 1, now(), now(), now(), '', 'ops@example.com', 'run-9')`)
	require.NoError(t, err)

	found, err := pgstatus.Find(ctx, pool, testTable, []string{"billing.paid", "notifications.mail"}, "order-7", 50)
	require.NoError(t, err)
	now := map[string]string{}
	for _, tr := range found.Trails {
		now[tr.MessageID] = tr.Now
		require.Equal(t, "order-7", tr.AggregateID, tr.MessageID)
	}
	require.NotContains(t, now, "m-other", "another order's message is not found")
	require.Len(t, now, 8)
	require.Contains(t, now["m-behind"], "waiting at the broker behind the held head m-held of partition ledger.post@3")
	require.Contains(t, now["m-pending"], "in the outbox, not dispatched yet")
	require.Equal(t, "handled by billing.paid", now["m-handled"])
	require.Contains(t, now["m-retry"], "waiting to be retried by notifications.mail (attempt 3)")
	require.Contains(t, now["m-held"], "holding its partition")
	require.Contains(t, now["m-held"], "ledger.post@3")
	require.Contains(t, now["m-poison"], "in the poison store")
	require.Contains(t, now["m-discarded"], "ferry poison undo --run run-9")
	require.Contains(t, now["m-broker"], "at the broker or being handled")

	// By a message id: its whole trail, oldest first.
	found, err = pgstatus.Find(ctx, pool, testTable, nil, "m-retry", 50)
	require.NoError(t, err)
	require.Len(t, found.Trails, 1)
	var stores []string
	for _, s := range found.Trails[0].Sightings {
		stores = append(stores, s.Store)
	}
	require.Equal(t, []string{"outbox", "durable retry"}, stores)
	require.Equal(t, "SMTP 451 try later", found.Trails[0].Sightings[1].Error)

	// By a correlation id: the messages of that request, with the trace.
	found, err = pgstatus.Find(ctx, pool, testTable, nil, "corr-7", 50)
	require.NoError(t, err)
	var ids []string
	for _, tr := range found.Trails {
		ids = append(ids, tr.MessageID)
	}
	require.ElementsMatch(t, []string{"m-pending", "m-handled", "m-poison"}, ids)

	found, err = pgstatus.Find(ctx, pool, testTable, nil, "nobody", 50)
	require.NoError(t, err)
	require.Empty(t, found.Trails)
	_, err = pgstatus.Find(ctx, pool, testTable, nil, strings.Repeat("x", 600), 50)
	require.Error(t, err)
}

func withHeaders(r pipelinetest.OutboxRow, h map[string]string) pipelinetest.OutboxRow {
	r.Headers = h
	return r
}
