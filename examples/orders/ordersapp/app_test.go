package ordersapp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	exmigrations "github.com/ferry-dev/ferry/examples/orders/migrations"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/examples/orders/ordersapp"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type harness struct {
	app      *app.App
	orders   *orders.Service
	cfg      app.Config
	provider *sandbox.PaymentProvider
	sink     *sandbox.SMTPSink
	// stop ends the app's Run and waits for it, as a shutdown would.
	stop func()
}

// testConfig is a configuration on a fresh schema and namespace, with the
// in-process payment provider and SMTP sink, and schedules short enough
// for tests.
// consoleToken is the tests' admin token: the console is read with it (a
// login or a Bearer header), as in production.
const consoleToken = "ordersapp-admin-token-0123"

func testConfig(t *testing.T) (app.Config, *sandbox.PaymentProvider, *sandbox.SMTPSink) {
	cfg, _, provider, sink := testConfigs(t)
	return cfg, provider, sink
}

// testConfigs is testConfig with the example's own configuration.
func testConfigs(t *testing.T) (app.Config, ordersapp.Config, *sandbox.PaymentProvider, *sandbox.SMTPSink) {
	t.Helper()
	world, err := sandbox.StartWorld()
	require.NoError(t, err)
	t.Cleanup(world.Close)
	provider, sink := world.Payments, world.SMTP
	cfg := app.Config{
		DatabaseURL:    pipelinetest.DatabaseURL(),
		DatabaseSchema: pipelinetest.Schema(t, exmigrations.Set),
		AMQP:           pipelinetest.Rabbit(t),
		Relay:          pgoutbox.RelayConfig{Backoff: pipeline.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}},
		Retry:          middleware.RetryConfig{MaxRetries: 2, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond},
		DurableRetry:   middleware.DurableRetryConfig{MaxAttempts: 3, Backoff: pipeline.Backoff{Initial: 50 * time.Millisecond, Max: 200 * time.Millisecond}},
		HTTPAddr:       "127.0.0.1:0",
		AdminAddr:      "127.0.0.1:0",
		AdminToken:     consoleToken,
	}
	return cfg, ordersapp.Config{PaymentURL: provider.URL(), SMTPAddr: sink.Addr()}.WithDefaults(), provider, sink
}

func start(t *testing.T, opts app.Options, what app.Components) *harness {
	t.Helper()
	cfg, provider, sink := testConfig(t)
	return startWith(t, cfg, provider, sink, opts, what)
}

func startWith(t *testing.T, cfg app.Config, provider *sandbox.PaymentProvider, sink *sandbox.SMTPSink, opts app.Options, what app.Components) *harness {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	// The example's application unless the test brings its own routes;
	// always the example's table (create_order writes it).
	if opts.Routes == nil {
		opts.Routes = ordersapp.Routes(ordersapp.Config{PaymentURL: provider.URL(), SMTPAddr: sink.Addr()}.WithDefaults())
	}
	if opts.HTTP == nil {
		opts.HTTP = ordersapp.HTTP
		if opts.Tools == nil {
			opts.Tools = ordersapp.Tools
		}
	}
	opts.Migrations = append(opts.Migrations, exmigrations.Set)
	a, err := app.New(context.Background(), cfg, opts)
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, a.Topology())
	t.Cleanup(func() { a.Close() })

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	ready := make(chan struct{})
	go func() { done <- a.Run(ctx, what, ready) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("app did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("app stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("app not ready after 30s")
	}
	svc, err := ordersapp.NewService(a)
	require.NoError(t, err)
	return &harness{app: a, orders: svc, cfg: a.Config(), provider: provider, sink: sink, stop: stop}
}

// settle proves the pipeline quiet instead of assuming it after a sleep:
// the outbox drained (nothing due, in backoff or retrying), then the app
// stopped as a deploy stops it (consumers finish and ack what they hold and
// hand back what they had received but not run), then every route's queue
// empty. No delivery, duplicate or not, is left anywhere to run an effect
// later: the counts a test asserts after it are final.
func settle(t *testing.T, h *harness) {
	t.Helper()
	pipelinetest.RequireDrained(t, h.app.Pool(), 30*time.Second)
	h.stop()
	stats, err := h.app.QueueStats(context.Background())
	require.NoError(t, err)
	for _, q := range stats {
		require.Zero(t, q.Ready, "queue %s still holds deliveries after the stop", q.Queue)
	}
}

// apiServer serves the example's HTTP API of h's app until the test ends.
func apiServer(t *testing.T, h *harness) *httptest.Server {
	t.Helper()
	api, err := ordersapp.HTTP(h.app)
	require.NoError(t, err)
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return srv
}

// eventually waits for cond, failing the test after two minutes: a bound
// for a hang, not a speed target (CI runs this package beside the chaos
// runs on two cores, under the race detector).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	eventuallyWithin(t, what, 2*time.Minute, cond)
}

// eventuallyWithin is eventually with a bound of the caller's: a bound for
// a stuck run, not a target.
func eventuallyWithin(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// channel opens an AMQP connection and channel of the test's own; close
// both with the returned function.
func (h *harness) channel(t *testing.T) (*amqp.Channel, func()) {
	t.Helper()
	conn, err := amqp.Dial(h.cfg.AMQP.URL)
	require.NoError(t, err)
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch, func() { ch.Close(); conn.Close() }
}

// poisoned returns what the poison store holds, oldest first.
func (h *harness) poisoned(t *testing.T) []pgpoison.Record {
	t.Helper()
	recs, err := h.app.Poison().List(context.Background(), "", 0)
	require.NoError(t, err)
	return recs
}

func TestRepeatedCreateOrderChargesAndMailsOnce(t *testing.T) {
	t.Parallel()
	h := start(t, app.Options{}, app.All)
	srv := apiServer(t, h)

	for i := range 3 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"user_id":"alice","amount":1200,"currency":"JPY"}`))
		req.Header.Set("Idempotency-Key", "same-key")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, map[bool]int{true: 201, false: 200}[i == 0], resp.StatusCode, string(body))
	}
	res, err := h.orders.CreateOrder(context.Background(), orders.Input{UserID: "alice", Amount: 1200, Currency: "JPY", IdempotencyKey: "same-key"})
	require.NoError(t, err)
	require.True(t, res.Deduped)

	eventually(t, "one charge and one mail", func() bool { return len(h.provider.Charges()) == 1 && len(h.sink.Mails()) == 1 })
	settle(t, h) // no duplicate left anywhere to show up later
	require.Len(t, h.provider.Charges(), 1)
	require.Equal(t, 1, h.provider.Requests())
	require.Len(t, h.sink.Mails(), 1)
	c := h.provider.Charges()[0]
	require.Equal(t, int64(1200), c.Amount)
	require.Equal(t, fmt.Sprint(res.OrderID), c.OrderID)
	require.True(t, strings.HasPrefix(c.IdempotencyKey, "ferry-payments.charge-"), c.IdempotencyKey)
	m := h.sink.Mails()[0]
	require.Equal(t, []string{"alice@example.com"}, m.To)
	require.Contains(t, m.Subject, fmt.Sprint(res.OrderID))
}

func TestRelayCrashAfterConfirmStillChargesOnce(t *testing.T) {
	t.Parallel()
	// Consumers only: the relay under test is driven by hand below.
	h := start(t, app.Options{}, app.Components{Consumers: true})
	_, err := h.orders.CreateOrder(context.Background(), orders.Input{UserID: "bob", Amount: 500, Currency: "USD", IdempotencyKey: "crash-1"})
	require.NoError(t, err)

	appName := pipelinetest.UniqueName("ferry-relay-")
	relayPool := pipelinetest.Pool(t, h.cfg.DatabaseSchema, appName)
	var once sync.Once
	crashing := &crashAfterConfirm{Publisher: h.app.BatchPublisher(), crash: func() {
		once.Do(func() {
			_, err := h.app.Pool().Exec(context.Background(),
				`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, appName)
			require.NoError(t, err)
		})
	}}
	relay, err := pgoutbox.NewRelay(relayPool, crashing, pgoutbox.RelayConfig{OrderedTopics: h.app.OrderedTopics()}, nil)
	require.NoError(t, err)
	_, err = relay.RelayBatch(context.Background())
	require.Error(t, err, "the relay's connection died before it recorded the dispatch")

	// The next run sends both events again.
	res, err := relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, res.Dispatched)

	eventually(t, "both redeliveries suppressed", func() bool { return h.app.Stats().Duplicates == 2 })
	require.Len(t, h.provider.Charges(), 1)
	require.Equal(t, 1, h.provider.Requests(), "the ledger must stop the second call, not only the provider")
	require.Len(t, h.sink.Mails(), 1)
}

// crashAfterConfirm publishes for real, then kills the relay's database
// connection: the broker has the message, the outbox does not know.
type crashAfterConfirm struct {
	message.Publisher
	crash func()
}

func (c *crashAfterConfirm) Publish(topic string, msgs ...*message.Message) error {
	if err := c.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	c.crash()
	return nil
}

func TestFailingHandlerEndsInPoisonQueueWithReason(t *testing.T) {
	t.Parallel()
	var calls sync.Map
	var mu sync.Mutex
	h := start(t, app.Options{Routes: func(d app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{
			Name: "always.fails", Topic: "work.fail",
			Handler: func(msg *message.Message) error {
				n, _ := calls.LoadOrStore(pipeline.MessageID(msg), new(int))
				mu.Lock()
				*n.(*int)++
				mu.Unlock()
				return errors.New("downstream refused: account closed")
			},
		}}, nil
	}}, app.Components{Relay: true, Consumers: true})
	publishEvent(t, h, "work.fail", "acct-1", map[string]string{"x": "y"})

	var poisoned []pgpoison.Record
	eventually(t, "the poisoned message", func() bool {
		poisoned = h.poisoned(t)
		return len(poisoned) > 0
	})
	require.Len(t, poisoned, 1)
	p := poisoned[0]
	require.Contains(t, p.Reason, "account closed")
	require.Contains(t, p.Reason, "gave up after 3 attempts")
	require.Equal(t, "work.fail", p.Topic, "the original topic, not the retry topic")
	require.Equal(t, "always.fails", p.Handler)
	require.True(t, strings.HasPrefix(p.Consumer, "always.fails@"), p.Consumer)
	require.Equal(t, "acct-1", p.AggregateID)
	require.NotEmpty(t, p.CorrelationID)
	require.Equal(t, 3, p.Attempts)
	require.False(t, p.Permanent)
	require.True(t, p.LastFailedAt.After(p.FirstFailedAt), "first %s, last %s", p.FirstFailedAt, p.LastFailedAt)
	require.JSONEq(t, `{"x":"y"}`, string(p.Payload))
	total := 0
	calls.Range(func(_, n any) bool { total += *n.(*int); return true })
	require.Equal(t, 9, total, "3 deliveries (2 of them durable retries) × (1 try + 2 quick retries)")
	processed, err := h.app.Ledger().Processed(context.Background(), "always.fails", p.MessageID)
	require.NoError(t, err)
	require.False(t, processed, "a failed message is never recorded as done")
	require.Len(t, h.outboxRows(t, pgoutbox.RowFilter{Topic: pipeline.RetryTopic}), 2, "each durable retry went through the outbox")
}

func TestPanickingHandlerIsPoisonedAndTheConsumerGoesOn(t *testing.T) {
	t.Parallel()
	var handled sync.Map
	h := start(t, app.Options{Routes: func(d app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{
			Name: "sometimes.panics", Topic: "work.panic",
			Handler: handlers.Typed(func(ctx context.Context, e *struct{ Panic bool }) error {
				if e.Panic {
					panic("nil map write, say")
				}
				handled.Store(handlers.MessageFromContext(ctx).UUID, true)
				return nil
			}),
		}}, nil
	}}, app.Components{Relay: true, Consumers: true})
	publishEvent(t, h, "work.panic", "a", map[string]bool{"Panic": true})
	publishEvent(t, h, "work.panic", "b", map[string]bool{"Panic": false})

	var poisoned []pgpoison.Record
	eventually(t, "the panicking message poisoned and the next one handled", func() bool {
		poisoned = h.poisoned(t)
		n := 0
		handled.Range(func(any, any) bool { n++; return true })
		return len(poisoned) == 1 && n == 1
	})
	require.Contains(t, poisoned[0].Reason, "panic occurred")
	require.Equal(t, "a", poisoned[0].AggregateID)
}

func TestMalformedMessageGoesStraightToPoison(t *testing.T) {
	t.Parallel()
	var calls int
	var mu sync.Mutex
	h := start(t, app.Options{Routes: func(d app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{
			Name: "typed.consumer", Topic: orders.TopicChargeRequested,
			Handler: handlers.Typed(func(ctx context.Context, e *orders.ChargeRequested) error {
				mu.Lock()
				calls++
				mu.Unlock()
				return nil
			}),
		}}, nil
	}}, app.Components{Consumers: true})

	ch, closeCh := h.channel(t)
	defer closeCh()
	exchange := h.app.Topology().ExchangeName(orders.TopicChargeRequested)
	bad := []amqp.Publishing{
		{MessageId: "m1", Body: []byte("not json"), Headers: amqp.Table{"schema_version": "1"}},
		{MessageId: "m2", Body: []byte(`{"order_id":1}`), Headers: amqp.Table{"schema_version": "1"}},                                                      // missing fields
		{MessageId: "m3", Body: []byte(`{"order_id":1,"user_id":"u","amount":5,"currency":"JPY"}`), Headers: amqp.Table{"schema_version": int32(99)}},      // unknown version, integer header
		{Body: []byte(`{"order_id":1,"user_id":"u","amount":5,"currency":"JPY"}`), Headers: amqp.Table{"schema_version": "1"}},                             // no message id
		{MessageId: "m5", Body: []byte(`{"order_id":1,"user_id":"` + strings.Repeat("x", 2<<20) + `"}`), Headers: amqp.Table{"schema_version": "1"}},       // huge
		{MessageId: "m6", Body: []byte(`{"order_id":1,"user_id":"u\u0000","amount":5,"currency":"JPY"}`), Headers: amqp.Table{"schema_version": "1"}},      // NUL: no retry could store it
		{MessageId: "m7", Body: []byte(`{"order_id":1,"user_id":"u","amount":5,"amount":9,"currency":"JPY"}`), Headers: amqp.Table{"schema_version": "1"}}, // duplicate key
		{MessageId: "m8", Body: []byte(`{"order_id":1,"user_id":"a> NOTIFY=SUCCESS ORCPT=rfc822;x@evil","amount":5,"currency":"JPY"}`), Headers: amqp.Table{"schema_version": "1"}},
	}
	for _, p := range bad {
		require.NoError(t, ch.PublishWithContext(context.Background(), exchange, "", false, false, p))
	}
	var poisoned []pgpoison.Record
	eventually(t, "every malformed message poisoned", func() bool {
		poisoned = h.poisoned(t)
		return len(poisoned) == len(bad)
	})
	reasons := map[string]string{}
	for _, p := range poisoned {
		reasons[p.MessageID] = p.Reason
		if p.MessageID == "m1" {
			require.Equal(t, "not json", string(p.Payload), "kept as received")
		}
		require.True(t, p.Permanent, p.Reason)
		require.Equal(t, 1, p.Attempts, "refused outright, not retried")
		require.Equal(t, orders.TopicChargeRequested, p.Topic)
	}
	require.Contains(t, reasons["m1"], "decoding")
	require.Contains(t, reasons["m2"], "user_id is missing")
	require.Contains(t, reasons["m3"], `unknown schema_version "99"`)
	require.Contains(t, reasons[""], "no id")
	require.Contains(t, reasons["m5"], "more than 1048576")
	require.Contains(t, reasons["m6"], "NUL character")
	require.Contains(t, reasons["m7"], "amount: is given twice")
	require.Contains(t, reasons["m8"], "user_id must be letters, digits")
	mu.Lock()
	defer mu.Unlock()
	require.Zero(t, calls)
}

func TestCorrelationAndTraceTravelToTheHandler(t *testing.T) {
	t.Parallel()
	type seen struct{ corr, trace, traceparent string }
	got := make(chan seen, 1)
	cfg, ex, provider, sink := testConfigs(t)
	h := startWith(t, cfg, provider, sink, app.Options{Routes: func(d app.Deps) ([]handlers.Route, error) {
		routes, err := ordersapp.Routes(ex)(d)
		return append(routes, handlers.Route{
			Name: "audit.charges", Topic: orders.TopicChargeRequested,
			Handler: handlers.Typed(func(ctx context.Context, e *orders.ChargeRequested) error {
				msg := handlers.MessageFromContext(ctx)
				got <- seen{pipeline.CorrelationIDFromContext(ctx), msg.Metadata.Get(pipeline.MetaTraceID), pipeline.TraceParentFromContext(ctx)}
				return nil
			}),
		}), err
	}}, app.All)
	srv := apiServer(t, h)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"user_id":"dana","amount":10,"currency":"USD"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "trace-1")
	req.Header.Set("X-Correlation-ID", "req-123")
	req.Header.Set("traceparent", tp)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, "req-123", resp.Header.Get("X-Correlation-ID"))

	select {
	case s := <-got:
		require.Equal(t, seen{"req-123", "4bf92f3577b34da6a3ce929d0e0e4736", tp}, s)
	case <-time.After(30 * time.Second):
		t.Fatal("audit handler never ran")
	}
	eventually(t, "the charge", func() bool { return len(h.provider.Charges()) == 1 })
}

func TestProviderOutageIsRetriedWithoutDoubleCharge(t *testing.T) {
	t.Parallel()
	h := start(t, app.Options{}, app.Components{Relay: true, Consumers: true})
	h.provider.FailNext(2) // two 503s, inside the retry budget
	_, err := h.orders.CreateOrder(context.Background(), orders.Input{UserID: "erin", Amount: 77, Currency: "JPY", IdempotencyKey: "outage-1"})
	require.NoError(t, err)
	eventually(t, "the charge", func() bool { return len(h.provider.Charges()) == 1 })
	require.Equal(t, 3, h.provider.Requests())
	require.Empty(t, h.poisoned(t))
}

func TestNewRefusesPendingMigrationsAndBadRoutes(t *testing.T) {
	t.Parallel()
	cfg, _, _ := testConfig(t)
	cfg.DatabaseSchema = pipelinetest.UniqueName("ferry_unmigrated_")
	_, err := app.New(context.Background(), cfg, app.Options{Logger: slog.New(slog.DiscardHandler)})
	require.ErrorIs(t, err, app.ErrNoRoutes, "no silent example: a route table is required")
	_, err = app.New(context.Background(), cfg, app.Options{Logger: slog.New(slog.DiscardHandler), Routes: ordersapp.Routes(ordersapp.Config{}.WithDefaults())})
	require.ErrorIs(t, err, app.ErrMigrationsPending)

	cfg, _, _ = testConfig(t)
	_, err = app.New(context.Background(), cfg, app.Options{Logger: slog.New(slog.DiscardHandler), Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "dup", Topic: "t", Handler: func(*message.Message) error { return nil }}, {Name: "dup", Topic: "u"}}, nil
	}})
	require.ErrorContains(t, err, `"dup" is used twice`)
	require.ErrorContains(t, err, "has no handler")
}

func publishEvent(t *testing.T, h *harness, topic, aggregate string, payload any) {
	t.Helper()
	msg, err := pipeline.NewEvent(context.Background(), aggregate, payload)
	require.NoError(t, err)
	tx, err := h.app.DB().BeginTx(context.Background(), nil)
	require.NoError(t, err)
	require.NoError(t, h.app.Outbox().PublishTx(context.Background(), tx, topic, msg))
	require.NoError(t, tx.Commit())
}

// mustPool opens a pool on the test's schema for components a route table builds.
func mustPool(t *testing.T, d app.Deps) *pgxpool.Pool {
	t.Helper()
	return pipelinetest.Pool(t, d.Config.DatabaseSchema, "ferry-test-routes")
}

// outboxRows is the outbox rows f chooses, in id order.
func (h *harness) outboxRows(t *testing.T, f pgoutbox.RowFilter) []pgoutbox.Row {
	t.Helper()
	rows, err := h.app.OutboxTable().Rows(context.Background(), h.app.Pool(), f)
	require.NoError(t, err)
	return rows
}
