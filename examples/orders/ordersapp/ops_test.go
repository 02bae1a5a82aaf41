package ordersapp_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func get(t *testing.T, h http.Handler, method, path, token string) (int, string) {
	t.Helper()
	req := httptest.NewRequest(method, path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	body, _ := io.ReadAll(rec.Body)
	return rec.Code, string(body)
}

func TestMetricsStatusAndAdminEndpoints(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.AdminToken = "s3cret-admin-token-0123"
	h := startWith(t, cfg, provider, sink, app.Options{}, app.Components{Relay: true, Consumers: true})
	_, err := h.orders.CreateOrder(context.Background(), orders.Input{UserID: "mia", Amount: 300, Currency: "JPY", IdempotencyKey: "m-1"})
	require.NoError(t, err)
	eventually(t, "the effects", func() bool { return len(h.provider.Charges()) == 1 && len(h.sink.Mails()) == 1 })
	pipelinetest.RequireDrained(t, h.app.Pool(), 10*time.Second)
	// A row that keeps failing, as the third alert watches for.
	tbl := h.app.OutboxTable()
	pipelinetest.InsertOutbox(t, h.app.Pool(), tbl, pipelinetest.OutboxRow{AggregateID: "stuck", Topic: "stripe.charge", Attempts: 7,
		LastError: "broker said no", AvailableAt: time.Now().Add(time.Hour)})
	// A week 40 days old still holding a row: past retention (30 days)
	// and the prune that should have cleared it, as a lock or a stopped
	// prune leaves it.
	old := time.Now().Add(-40 * 24 * time.Hour)
	pipelinetest.InsertOutbox(t, h.app.Pool(), tbl, pipelinetest.OutboxRow{AggregateID: "old", Topic: "stripe.charge", CreatedAt: old,
		Dispatched: true, DispatchedAt: old})
	require.NoError(t, h.app.Metrics().Refresh(context.Background(), h.app.Pool()))

	admin := h.app.AdminHandler()
	// A handler's outcome is counted after its ledger commit, a moment
	// after the effect the sink saw.
	eventually(t, "both handlers counted", func() bool {
		_, body := get(t, admin, "GET", "/metrics", "")
		return strings.Contains(body, `ferry_consumer_messages_total{handler="payments.charge",outcome="handled"} 1`) &&
			strings.Contains(body, `ferry_consumer_messages_total{handler="notifications.mail",outcome="handled"} 1`)
	})
	code, body := get(t, admin, "GET", "/metrics", "")
	require.Equal(t, 200, code)
	for _, want := range []string{
		`outbox_dispatched_total{topic="stripe.charge"} 1`,
		`outbox_dispatched_total{topic="mail.send"} 1`,
		`outbox_dispatch_latency_seconds_count{topic="stripe.charge"} 1`,
		`outbox_attempts_count 2`,
		`outbox_pending_total{topic="stripe.charge"} 1`,
		`outbox_pending_due_total{topic="stripe.charge"} 0`,
		`outbox_pending_max_attempts 7`,
		`ferry_retention_overdue_partitions{table="outbox"} 1`,
		`ferry_retention_overdue_partitions{table="ledger"} 0`,
		`ferry_retention_overdue_seconds{table="ledger"} 0`,
		`ferry_consumer_messages_total{handler="payments.charge",outcome="handled"} 1`,
		`ferry_consumer_messages_total{handler="notifications.mail",outcome="handled"} 1`,
		`handler_execution_time_seconds`, // Watermill's router metrics
	} {
		require.Contains(t, body, want)
	}

	code, body = get(t, admin, "GET", "/readyz", "")
	require.Equal(t, 200, code, body)
	require.JSONEq(t, `{"database":"ok","broker":"ok","migrations":"ok"}`, body)
	code, _ = get(t, admin, "GET", "/healthz", "")
	require.Equal(t, 200, code)
	code, _ = get(t, admin, "POST", "/admin/prune", "")
	require.Equal(t, 401, code)
	code, _ = get(t, admin, "POST", "/admin/prune", "wrong")
	require.Equal(t, 401, code)
	code, body = get(t, admin, "POST", "/admin/prune", "s3cret-admin-token-0123")
	require.Equal(t, 200, code, body)
	require.Contains(t, body, `"target":"ledger"`)
	// The scheme is case-insensitive; the token is not.
	req := httptest.NewRequest("POST", "/admin/prune", nil)
	req.Header.Set("Authorization", "bearer s3cret-admin-token-0123")
	rec := httptest.NewRecorder()
	admin.ServeHTTP(rec, req)
	require.Equal(t, 200, rec.Code, rec.Body.String())
	code, _ = get(t, admin, "POST", "/admin/prune", "S3CRET-ADMIN-TOKEN-0123")
	require.Equal(t, 401, code)
	_, body = get(t, admin, "GET", "/metrics", "")
	require.Contains(t, body, "ferry_unrouted_messages ", "the unrouted queue's depth is a metric")
	overdue := regexp.MustCompile(`(?m)^ferry_retention_overdue_seconds\{table="outbox"\} (\S+)$`).FindStringSubmatch(body)
	require.NotNil(t, overdue, body)
	age, err := strconv.ParseFloat(overdue[1], 64)
	require.NoError(t, err)
	require.Greater(t, age, 24*3600.0, "the old week has been past retention for more than a day")
	// The prune above cleared the old week.
	require.NoError(t, h.app.Metrics().Refresh(context.Background(), h.app.Pool()))
	_, body = get(t, admin, "GET", "/metrics", "")
	require.Contains(t, body, `ferry_retention_overdue_partitions{table="outbox"} 0`)
	require.Contains(t, body, `ferry_retention_overdue_seconds{table="outbox"} 0`)

	rep, err := pgstatus.Collect(context.Background(), h.app.Pool(), pgoutbox.Table{}, pgstatus.DefaultAttemptsThreshold)
	require.NoError(t, err)
	require.Equal(t, 1, rep.PendingTotal)
	require.Len(t, rep.Failing, 1)
	require.Equal(t, "broker said no", rep.Failing[0].LastError)
	require.Equal(t, 1, rep.RelaysAlive)
	require.Equal(t, 1, rep.ConsumersAlive)
	require.Zero(t, rep.PoisonTotal)

	h.stop()
	rep, err = pgstatus.Collect(context.Background(), h.app.Pool(), pgoutbox.Table{}, 5)
	require.NoError(t, err)
	require.Empty(t, rep.Instances, "a clean stop removes the heartbeat")

	// /readyz says what failed, never the driver's text (hosts, users, databases).
	h.app.Pool().Close()
	code, body = get(t, admin, "GET", "/readyz", "")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, `"database":"unreachable`)
	require.NotContains(t, body, "closed pool")
	require.NotContains(t, body, "ferry_test_")
}

func TestAdminWithoutTokenRefusesStateChanges(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.AdminToken = "" // none set
	h := startWith(t, cfg, provider, sink, app.Options{}, app.Components{})
	code, body := get(t, h.app.AdminHandler(), "POST", "/admin/prune", "anything")
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "FERRY_ADMIN_TOKEN")
}

// One trace id follows an order from the HTTP request through the outbox
// row, the AMQP message and the handler, to the event the handler
// publishes and the handler of that event.
func TestTraceFollowsOneTraceIDAcrossHops(t *testing.T) {
	t.Parallel()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())

	type hop struct{ traceID, traceparent string }
	second := make(chan hop, 1)
	var a *app.App
	h := start(t, app.Options{TracerProvider: tp, Routes: func(d app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{
			{Name: "trace.first", Topic: orders.TopicChargeRequested, Handler: handlers.Typed(func(ctx context.Context, e *orders.ChargeRequested) error {
				// The handler publishes onward, through the outbox, from its own context.
				msg, err := pipeline.NewEvent(ctx, "receipt", map[string]int64{"order_id": e.OrderID})
				if err != nil {
					return err
				}
				tx, err := a.DB().BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer tx.Rollback()
				if err := a.Outbox().PublishTx(ctx, tx, "receipt.issued", msg); err != nil {
					return err
				}
				return tx.Commit()
			})},
			{Name: "trace.second", Topic: "receipt.issued", Handler: func(msg *message.Message) error {
				second <- hop{msg.Metadata.Get(pipeline.MetaTraceID), pipeline.TraceParentFromContext(msg.Context())}
				return nil
			}},
		}, nil
	}}, app.All)
	a = h.app
	srv := apiServer(t, h)
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"user_id":"tess","amount":10,"currency":"USD"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "trace-hops")
	req.Header.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)

	headers := h.outboxRows(t, pgoutbox.RowFilter{Topic: orders.TopicChargeRequested})[0].Headers
	require.Equal(t, traceID, headers[pipeline.MetaTraceID], "the outbox row carries the request's trace")

	select {
	case got := <-second:
		require.Equal(t, traceID, got.traceID)
		require.Contains(t, got.traceparent, traceID)
	case <-time.After(30 * time.Second):
		t.Fatal("the onward event was never handled")
	}
	eventually(t, "the consumer spans", func() bool {
		n := 0
		for _, s := range spans.Ended() {
			if strings.HasPrefix(s.Name(), "consume ") {
				n++
			}
		}
		return n >= 2 // stripe.charge, receipt.issued
	})
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		require.Equal(t, traceID, s.SpanContext().TraceID().String(), "span %s left the trace", s.Name())
		byName[s.Name()] = s
	}
	require.Contains(t, byName, "POST /orders")
	require.Contains(t, byName, "consume stripe.charge")
	require.Contains(t, byName, "consume receipt.issued")
	// The relay's span sits between the commit and the consumer: no gap.
	pub := byName["publish stripe.charge"]
	require.NotNil(t, pub, "the relay opens a span per published event")
	require.Equal(t, trace.SpanKindProducer, pub.SpanKind())
	attrs := map[string]string{}
	for _, kv := range pub.Attributes() {
		attrs[string(kv.Key)] = kv.Value.Emit()
	}
	require.Equal(t, orders.TopicChargeRequested, attrs["messaging.destination.name"])
	require.NotEmpty(t, attrs["ferry.outbox_id"])
	require.NotEmpty(t, attrs["messaging.message.id"])
	require.Equal(t, byName["POST /orders"].SpanContext().SpanID(), pub.Parent().SpanID(), "published within the request's trace")
	require.Equal(t, pub.SpanContext().SpanID(), byName["consume stripe.charge"].Parent().SpanID(), "the consumer follows from the relay's span")
	require.Contains(t, byName, "publish receipt.issued")
}

// Consumer log lines carry the message's ids (pipeline.LogHandler).
func TestConsumerLogLinesCarryMessageFields(t *testing.T) {
	t.Parallel()
	var buf pipelinetest.SyncBuffer
	cfg, err := app.ConfigFromLookup(func(string) (string, bool) { return "", false })
	require.NoError(t, err)
	cfg.LogFormat = "json"
	logger, err := app.NewLogger(cfg, &buf)
	require.NoError(t, err)
	h := start(t, app.Options{Logger: logger, Routes: func(d app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "log.worker", Topic: "work.log", Handler: handlers.Typed(func(ctx context.Context, j *job) error {
			d.Logger.InfoContext(ctx, "working on it", "n", j.N)
			return nil
		})}}, nil
	}}, app.Components{Relay: true, Consumers: true})
	ctx := pipeline.ContextWithTraceParent(context.Background(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	msg, err := pipeline.NewEvent(pipeline.ContextWithCorrelationID(ctx, "corr-log"), "acct-9", job{N: 9})
	require.NoError(t, err)
	tx, err := h.app.DB().BeginTx(context.Background(), nil)
	require.NoError(t, err)
	require.NoError(t, h.app.Outbox().PublishTx(context.Background(), tx, "work.log", msg))
	require.NoError(t, tx.Commit())
	var line map[string]any
	eventually(t, "the handler's log line", func() bool {
		for _, l := range strings.Split(buf.String(), "\n") {
			if strings.Contains(l, `"working on it"`) {
				return json.Unmarshal([]byte(l), &line) == nil
			}
		}
		return false
	})
	require.Equal(t, "work.log", line["topic"])
	require.Equal(t, "acct-9", line["aggregate_id"])
	require.Equal(t, "corr-log", line["correlation_id"])
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", line["trace_id"])
	require.EqualValues(t, 1, line["attempt"])
	require.NotEmpty(t, line["message_id"])
}
