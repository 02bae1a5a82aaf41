package middleware_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func defaultChain(t testing.TB) middleware.Chain { return defaultChainLogging(t, nil) }

// defaultChainLogging is the default chain logging to logger.
func defaultChainLogging(t testing.TB, logger *slog.Logger) middleware.Chain {
	// pgxpool.New connects lazily: building the chain needs no server.
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/unused")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	guard, err := middleware.NewIdempotency(ledger, nil)
	require.NoError(t, err)
	resched, err := pgoutbox.NewRescheduler(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	chain, err := middleware.DefaultChain(middleware.ChainConfig{
		Poison:       middleware.PoisonConfig{Publisher: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})},
		DurableRetry: middleware.DurableRetryConfig{Scheduler: resched},
		Idempotency:  guard,
		Logger:       logger,
	})
	require.NoError(t, err)
	return chain
}

func TestDefaultChainOrder(t *testing.T) {
	t.Parallel()
	require.Equal(t, []string{"correlation", "poison", "durable-retry", "infrastructure", "retry", "recoverer", "idempotency"}, defaultChain(t).Names())
}

func TestChainEdits(t *testing.T) {
	t.Parallel()
	chain := defaultChain(t)
	noop := func(h message.HandlerFunc) message.HandlerFunc { return h }

	edited, err := chain.InsertBefore(middleware.LinkPoison, middleware.Link{Name: "a", Middleware: noop})
	require.NoError(t, err)
	edited, err = edited.InsertAfter(middleware.LinkIdempotency, middleware.Link{Name: "b", Middleware: noop})
	require.NoError(t, err)
	edited, err = edited.Append(middleware.Link{Name: "c", Middleware: noop})
	require.NoError(t, err)
	require.Equal(t, []string{"correlation", "a", "poison", "durable-retry", "infrastructure", "retry", "recoverer", "idempotency", "b", "c"}, edited.Names())
	require.Len(t, edited.Middlewares(), 10)
	require.Len(t, chain, 7, "editing returns a new chain")

	_, err = chain.InsertAfter("nope", middleware.Link{Name: "x", Middleware: noop})
	require.ErrorContains(t, err, `no link "nope"`)
	_, err = chain.Append(middleware.Link{Name: middleware.LinkRetry, Middleware: noop})
	require.ErrorContains(t, err, "already has")
	_, err = chain.Append(middleware.Link{Name: "x"})
	require.Error(t, err)
}

func TestDefaultChainNeedsItsParts(t *testing.T) {
	t.Parallel()
	_, err := middleware.DefaultChain(middleware.ChainConfig{})
	require.Error(t, err)
	_, err = middleware.RetryConfig{InitialInterval: -1}.Middleware(nil)
	require.Error(t, err)
}

func TestCorrelationKeepsOrCreatesID(t *testing.T) {
	t.Parallel()
	var inCtx string
	h := middleware.Correlation(func(msg *message.Message) ([]*message.Message, error) {
		inCtx = pipeline.CorrelationIDFromContext(msg.Context())
		return []*message.Message{message.NewMessage("out", nil)}, nil
	})

	in := message.NewMessage("1", nil)
	in.Metadata.Set(pipeline.MetaCorrelationID, "given")
	out, err := h(in)
	require.NoError(t, err)
	require.Equal(t, "given", inCtx)
	require.Equal(t, "given", out[0].Metadata.Get(pipeline.MetaCorrelationID))

	out, err = h(message.NewMessage("2", nil))
	require.NoError(t, err)
	require.NotEmpty(t, inCtx)
	require.Equal(t, inCtx, out[0].Metadata.Get(pipeline.MetaCorrelationID))
}

func TestRetrySkipsPermanentErrors(t *testing.T) {
	t.Parallel()
	retry, err := middleware.RetryConfig{MaxRetries: 3, InitialInterval: 1, MaxInterval: 1}.Middleware(nil)
	require.NoError(t, err)
	calls := 0
	_, err = retry(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, pipeline.Permanent(fmt.Errorf("bad payload"))
	})(message.NewMessage("1", nil))
	require.Error(t, err)
	require.Equal(t, 1, calls)

	calls = 0
	_, err = retry(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, fmt.Errorf("flaky")
	})(message.NewMessage("2", nil))
	require.Error(t, err)
	require.Equal(t, 4, calls)
}

// An application's own link: log every message with its correlation id,
// right inside the correlation link so the id is already there.
func ExampleChain_InsertAfter() {
	chain := defaultChainForExample()
	logging := middleware.Link{Name: "audit-log", Middleware: func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			// slog.InfoContext(msg.Context(), "handling", "message_id", msg.UUID, ...)
			return h(msg)
		}
	}}
	chain, err := chain.InsertAfter(middleware.LinkCorrelation, logging)
	if err != nil {
		panic(err)
	}
	fmt.Println(strings.Join(chain.Names(), " → "))
	// router.AddMiddleware(chain.Middlewares()...)

	// Output: correlation → audit-log → poison → durable-retry → infrastructure → retry → recoverer → idempotency
}

func defaultChainForExample() middleware.Chain {
	pool, _ := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/app")
	ledger, _ := pgledger.New(pool, pgledger.Config{}, nil)
	guard, _ := middleware.NewIdempotency(ledger, nil)
	outbox, _ := pgoutbox.New(pgoutbox.Config{}, nil)
	resched, _ := pgoutbox.NewRescheduler(pool, outbox)
	chain, _ := middleware.DefaultChain(middleware.ChainConfig{
		Poison:       middleware.PoisonConfig{Publisher: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})},
		DurableRetry: middleware.DurableRetryConfig{Scheduler: resched},
		Idempotency:  guard,
	})
	return chain
}

// A link of the application's, placed after correlation, logs through the
// application's logger (pipeline.Logger on the message's context): its
// lines are in the application's format, with the message's fields, not
// plain text from slog's default logger inside a JSON stream.
func TestLinksLogThroughTheApplicationsLogger(t *testing.T) {
	t.Parallel()
	var logs pipelinetest.SyncBuffer
	logger := slog.New(pipeline.LogHandler(slog.NewJSONHandler(&logs, nil)))
	chain, err := defaultChainLogging(t, logger).InsertAfter(middleware.LinkCorrelation, middleware.Link{Name: "audit", Middleware: func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			pipeline.Logger(msg.Context()).InfoContext(msg.Context(), "audit link saw a message")
			return nil, nil // stops here: the rest of the chain needs a database
		}
	}})
	require.NoError(t, err)
	var h message.HandlerFunc = func(*message.Message) ([]*message.Message, error) { return nil, nil }
	mws := chain.Middlewares()
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	_, err = h(message.NewMessage("m-7", nil))
	require.NoError(t, err)
	var line map[string]any
	require.NoError(t, json.Unmarshal([]byte(strings.TrimSpace(logs.String())), &line), logs.String())
	require.Equal(t, "audit link saw a message", line["msg"])
	require.Equal(t, "m-7", line["message_id"], "with the message's fields")
}
