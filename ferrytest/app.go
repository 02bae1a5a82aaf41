package ferrytest

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// AppConfig is the configuration App starts an application with, on
// schema and the broker configuration rmq (see Schema and Rabbit): the
// test servers, the admin server off, the HTTP API on a free loopback
// port, and delays short enough for a test (the relay retries a failed
// publish after 50 ms; handlers get two quick retries 5 ms apart and
// three deliveries 50 ms apart before the poison store). The relay's
// wake-ups, probe and poll are the defaults, so a test sees the latency
// its service will see.
func AppConfig(schema string, rmq rabbit.Config) app.Config {
	return app.Config{
		DatabaseURL:    DatabaseURL(),
		DatabaseSchema: schema,
		AMQP:           rmq,
		HTTPAddr:       "127.0.0.1:0",
		AdminAddr:      "off",
		Relay:          pgoutbox.RelayConfig{Table: outboxTable(), Backoff: pipeline.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}},
		Retry:          middleware.RetryConfig{MaxRetries: 2, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond},
		DurableRetry: middleware.DurableRetryConfig{MaxAttempts: 3,
			Backoff: pipeline.Backoff{Initial: 50 * time.Millisecond, Max: 200 * time.Millisecond}},
		LogLevel: "warn",
	}
}

// App starts the application opts describes for a test, as `run` would:
// in a fresh schema migrated with Ferry's and opts.Migrations, with a
// RabbitMQ namespace of its own, every component running (relay,
// consumers, HTTP API at a.APIAddr(), pruner). It returns once they are
// ready. When the test ends it stops them, deletes the broker topology and
// drops the schema. configure, if given, adjusts the configuration first
// (see AppConfig for what it starts from).
func App(t testing.TB, opts app.Options, configure ...func(*app.Config)) *app.App {
	t.Helper()
	SkipShort(t)
	a, _ := AppOn(t, Schema(t, opts.Migrations...), Rabbit(t), opts, configure...)
	return a
}

// AppOn starts the application as App does, on a schema and a broker
// namespace the test already has (Schema, Rabbit), which it neither makes
// nor drops, and returns it with stop, which stops it now (the test's
// cleanup stops it otherwise). For two releases of a service, one after
// the other, on the same stored events and queues: start release 1 with
// AppOn, publish, stop it, start release 2's options with AppOn on the
// same schema and rmq, and RequireHandled (or RequireStoredEventsDecode)
// proves release 1's events reach release 2. Migrations of opts not
// applied yet are applied at start.
func AppOn(t testing.TB, schema string, rmq rabbit.Config, opts app.Options, configure ...func(*app.Config)) (a *app.App, stop func()) {
	t.Helper()
	SkipShort(t)
	cfg := AppConfig(schema, rmq)
	opts.Migrate = true
	for _, c := range configure {
		c(&cfg)
	}
	if opts.Logger == nil {
		w := &testWriter{t: t}
		t.Cleanup(w.close) // first registered, so it runs after the app stopped
		opts.Logger = slog.New(pipeline.LogHandler(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn})))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		t.Fatalf("starting the application: %v", err)
	}
	TeardownTopology(t, a.Topology())
	stopApp, err := a.Start(context.Background(), app.All)
	if err != nil {
		_ = a.Close()
		t.Fatalf("starting the application: %v", err)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			if err := stopApp(); err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("the application stopped with: %v", err)
			}
			_ = a.Close()
		})
	}
	t.Cleanup(stop)
	return a, stop
}

// testWriter sends the application's log lines to the test's log, shown
// when the test fails (or with -v); once the test is over it drops them,
// since testing refuses a log after the test.
type testWriter struct {
	t      testing.TB
	mu     sync.Mutex
	closed bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (w *testWriter) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
}
