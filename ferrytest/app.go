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
	cfg := AppConfig(Schema(t, opts.Migrations...), Rabbit(t))
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
	t.Cleanup(func() { _ = a.Close() })
	stop, err := a.Start(context.Background(), app.All)
	if err != nil {
		t.Fatalf("starting the application: %v", err)
	}
	t.Cleanup(func() {
		if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("the application stopped with: %v", err)
		}
	})
	return a
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
