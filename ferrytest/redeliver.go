package ferrytest

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Redeliver delivers the event with messageID (an outbox row's message id)
// to a's consumers once more, as the broker does after a lost ack or a
// crash between the effect and the ack, and returns once every handler
// route on its topic has seen the copy and skipped it as a duplicate (the
// app's ledger counted it), failing the test after timeout. A test of
// "delivered twice, effect once" then checks that the effect happened
// once:
//
//	ferrytest.RequireHandled(t, a.Pool(), a.Routes(), 10*time.Second)
//	ferrytest.Redeliver(t, a, msg.UUID, 10*time.Second)
//	require.Equal(t, 1, mails.Count(orderID))
//
// a must run its consumers in this process (App does). Batch routes keep
// no per-message duplicate count, so only routes with a Handler are
// waited for; a topic with none fails the test.
func Redeliver(t testing.TB, a *app.App, messageID string, timeout time.Duration) {
	t.Helper()
	ctx := context.Background()
	rows, err := a.OutboxTable().Rows(ctx, a.Pool(), pgoutbox.RowFilter{MessageID: messageID})
	if err != nil || len(rows) != 1 {
		t.Fatalf("ferrytest: Redeliver: reading outbox row of message %s: %d row(s), %v", messageID, len(rows), err)
	}
	topic, aggregate, payload := rows[0].Topic, rows[0].AggregateID, rows[0].Payload
	waitFor := 0
	for _, r := range a.Routes() {
		if r.Topic == topic && r.Handler != nil {
			waitFor++
		}
	}
	if waitFor == 0 {
		t.Fatalf("ferrytest: Redeliver: no route with a Handler consumes %s", topic)
	}
	msg := message.NewMessage(messageID, payload)
	for k, v := range rows[0].Headers {
		msg.Metadata.Set(k, v)
	}
	if aggregate != "" {
		msg.Metadata.Set(pipeline.MetaAggregateID, aggregate)
	}
	before := a.Stats().Duplicates
	// The relay's publisher, which routes an ordered topic's message to
	// its aggregate's partition: a.Publisher sends to unordered topics only,
	// and a copy sent with it to an ordered topic reached no queue.
	if err := a.BatchPublisher().Publish(topic, msg); err != nil {
		t.Fatalf("ferrytest: Redeliver: publishing the copy of %s: %v", messageID, err)
	}
	deadline := time.Now().Add(timeout)
	for a.Stats().Duplicates < before+int64(waitFor) {
		if time.Now().After(deadline) {
			t.Fatalf("ferrytest: Redeliver: after %s, %d of %d route(s) on %s had skipped the copy of %s as a duplicate (did one run it again?)",
				timeout, a.Stats().Duplicates-before, waitFor, topic, messageID)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
