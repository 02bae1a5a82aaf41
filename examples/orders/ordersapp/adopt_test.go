package ordersapp_test

import (
	"context"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// Shadow intents (by topic configuration or by their own mark) never reach
// RabbitMQ: the relay marks them dispatched and shadowed, and counts them.
// A live intent beside them is delivered as usual.
func TestShadowIntentsNeverReachTheBroker(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.Relay.ShadowTopics = []string{"legacy.welcome"}
	var handled atomic.Int32
	var live atomic.Int32
	h := startWith(t, cfg, provider, sink, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{
			{Name: "welcome.mailer", Topic: "legacy.welcome", Handler: func(*message.Message) error { handled.Add(1); return nil }},
			{Name: "receipt.mailer", Topic: "legacy.receipt", Handler: func(msg *message.Message) error {
				if msg.Metadata.Get(pipeline.MetaShadow) == "true" {
					handled.Add(1)
				} else {
					live.Add(1)
				}
				return nil
			}},
		}, nil
	}}, app.Components{Relay: true, Consumers: true})
	ctx := context.Background()
	publishEvent(t, h, "legacy.welcome", "user-1", map[string]string{"user": "1"}) // shadow by topic
	tx, err := h.app.DB().BeginTx(ctx, nil)
	require.NoError(t, err)
	marked, err := pipeline.NewEvent(ctx, "order-9", map[string]int{"order": 9})
	require.NoError(t, err)
	require.NoError(t, h.app.Outbox().PublishTx(ctx, tx, "legacy.receipt", pipeline.WithShadow(marked))) // shadow by mark
	// The legacy code records its effects in its own transaction.
	require.NoError(t, shadow.RecordLegacy(ctx, tx, "legacy.receipt", "order-9"))
	require.NoError(t, tx.Commit())
	publishEvent(t, h, "legacy.receipt", "order-10", map[string]int{"order": 10}) // live
	// Business data never shadows an intent: a client's JSON embedded in
	// the payload could otherwise suppress its own effect.
	publishEvent(t, h, "legacy.receipt", "order-11", map[string]any{"order": 11, "shadow_mode": true})
	publishEvent(t, h, "legacy.receipt", "order-12", map[string]any{"order": 12, "shadow_mode": "true"})

	eventually(t, "the live intents handled", func() bool { return live.Load() == 3 })
	pipelinetest.RequireDrained(t, h.app.Pool(), 10*time.Second)
	shadowed := 0
	for _, r := range h.outboxRows(t, pgoutbox.RowFilter{}) {
		if r.Shadowed && r.Dispatched {
			shadowed++
		}
	}
	require.Equal(t, 2, shadowed)
	settle(t, h)
	require.Zero(t, handled.Load(), "no shadow intent reached a consumer")
	n, err := h.app.UnroutedDepth(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "nor the broker at all")
	rec := httptest.NewRecorder()
	h.app.AdminHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	require.Contains(t, rec.Body.String(), `outbox_shadow_events_total{topic="legacy.welcome"} 1`)
	require.Contains(t, rec.Body.String(), `outbox_shadow_events_total{topic="legacy.receipt"} 1`)
	require.NotContains(t, rec.Body.String(), `outbox_dispatched_total{topic="legacy.welcome"}`)

	rep, err := shadow.Report(ctx, h.app.Pool(), shadow.Options{Since: time.Hour, ShadowTopics: cfg.Relay.ShadowTopics})
	require.NoError(t, err)
	byTopic := map[string]shadow.TopicReport{}
	for _, tr := range rep.Topics {
		byTopic[tr.Topic] = tr
	}
	require.Empty(t, byTopic["legacy.receipt"].MissingInLegacy, "a payload's shadow_mode makes no shadow intent: %+v", byTopic["legacy.receipt"])
	require.Equal(t, 1, byTopic["legacy.receipt"].Matched)
	require.Equal(t, []string{"user-1"}, byTopic["legacy.welcome"].MissingInLegacy, "the welcome had no legacy record")
	require.False(t, rep.Agree())
}
