package ferrytest

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline"
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
	var topic, aggregate string
	var payload, headers []byte
	err := a.Pool().QueryRow(ctx, `SELECT topic, aggregate_id, COALESCE(payload_raw, convert_to(payload::text, 'UTF8')), headers
		FROM outbox WHERE message_uuid = $1`, messageID).Scan(&topic, &aggregate, &payload, &headers)
	if err != nil {
		t.Fatalf("ferrytest: Redeliver: reading outbox row of message %s: %v", messageID, err)
	}
	waitFor := 0
	for _, r := range a.Routes() {
		if r.Topic == topic && r.Handler != nil {
			waitFor++
		}
	}
	if waitFor == 0 {
		t.Fatalf("ferrytest: Redeliver: no route with a Handler consumes %s", topic)
	}
	h := map[string]any{}
	if err := json.Unmarshal(headers, &h); err != nil {
		t.Fatalf("ferrytest: Redeliver: headers of message %s: %v", messageID, err)
	}
	msg := message.NewMessage(messageID, payload)
	for k, v := range h {
		if s, ok := v.(string); ok {
			msg.Metadata.Set(k, s)
		}
	}
	if aggregate != "" {
		msg.Metadata.Set(pipeline.MetaAggregateID, aggregate)
	}
	before := a.Stats().Duplicates
	if err := a.Publisher().Publish(topic, msg); err != nil {
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
