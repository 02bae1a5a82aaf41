package middleware

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/ferry-dev/ferry/pipeline"
)

// Names of the links of the default chain, for Chain.InsertBefore/InsertAfter.
const (
	LinkCorrelation    = "correlation"
	LinkTracing        = "tracing"
	LinkTracingAttempt = "tracing-attempt"
	LinkPoison         = "poison"
	LinkDurableRetry   = "durable-retry"
	LinkInfra          = "infrastructure"
	LinkRetry          = "retry"
	LinkRecoverer      = "recoverer"
	LinkIdempotency    = "idempotency"
	// LinkPark is a tenant fleet's park link (tenancy.Parking), right
	// inside LinkInfra.
	LinkPark = "park"
)

// Link is one named middleware of a chain.
type Link struct {
	Name       string
	Middleware message.HandlerMiddleware
}

// Chain is an ordered list of middleware, outermost first: the first link
// sees a message first and its result last. It is a value; the editing
// methods return a new Chain.
type Chain []Link

// Names returns the link names in order.
func (c Chain) Names() []string {
	names := make([]string, len(c))
	for i, l := range c {
		names[i] = l.Name
	}
	return names
}

// Middlewares returns the middleware in order, for message.Router.AddMiddleware.
func (c Chain) Middlewares() []message.HandlerMiddleware {
	m := make([]message.HandlerMiddleware, len(c))
	for i, l := range c {
		m[i] = l.Middleware
	}
	return m
}

// Without returns the chain without the link named name, if it has one.
func (c Chain) Without(name string) Chain {
	return slices.DeleteFunc(slices.Clone(c), func(l Link) bool { return l.Name == name })
}

// Append adds links innermost, right around the handlers.
func (c Chain) Append(links ...Link) (Chain, error) {
	return c.insertAt(len(c), links)
}

// InsertBefore adds links just outside the link named name.
func (c Chain) InsertBefore(name string, links ...Link) (Chain, error) {
	i := slices.IndexFunc(c, func(l Link) bool { return l.Name == name })
	if i < 0 {
		return nil, fmt.Errorf("middleware chain has no link %q (links: %v)", name, c.Names())
	}
	return c.insertAt(i, links)
}

// InsertAfter adds links just inside the link named name.
func (c Chain) InsertAfter(name string, links ...Link) (Chain, error) {
	i := slices.IndexFunc(c, func(l Link) bool { return l.Name == name })
	if i < 0 {
		return nil, fmt.Errorf("middleware chain has no link %q (links: %v)", name, c.Names())
	}
	return c.insertAt(i+1, links)
}

func (c Chain) insertAt(i int, links []Link) (Chain, error) {
	for _, l := range links {
		if l.Name == "" || l.Middleware == nil {
			return nil, errors.New("a middleware link needs a name and a middleware")
		}
		if slices.ContainsFunc(c, func(x Link) bool { return x.Name == l.Name }) {
			return nil, fmt.Errorf("middleware chain already has a link %q", l.Name)
		}
	}
	return slices.Insert(slices.Clone(c), i, links...), nil
}

// ChainConfig is what the default chain needs.
type ChainConfig struct {
	// Poison configures where messages that keep failing go. Required.
	Poison PoisonConfig
	// DurableRetry configures the delayed retries that survive restarts. Required (its Scheduler).
	DurableRetry DurableRetryConfig
	// Retry configures the quick in-process retries.
	Retry RetryConfig
	// Infrastructure configures how failures of Ferry's own infrastructure
	// are waited out.
	Infrastructure InfrastructureConfig
	// Idempotency is the ledger guard. Required.
	Idempotency *Idempotency
	// Logger receives the chain's log lines. Default: discard.
	Logger *slog.Logger
	// Recorder, if set, is told every delivery's outcome (metrics). It is
	// given to the links that have none of their own.
	Recorder Recorder
	// Tracing, if set, is the link that continues the message's trace (see
	// Tracing); it sits right inside correlation.
	Tracing message.HandlerMiddleware
	// TracingAttempt, if set, is the link that gives each attempt its own
	// span; it sits right inside the durable retry, which runs the
	// attempts of a held partition one after another.
	TracingAttempt message.HandlerMiddleware
	// Pause, if its Source is set, is the pause link (PauseConfig).
	Pause PauseConfig
}

// DefaultChain returns Ferry's consumer chain, outermost first. This is the
// one place its order is decided; every link says why it sits where it does.
func DefaultChain(cfg ChainConfig) (Chain, error) {
	if cfg.Idempotency == nil {
		return nil, errors.New("middleware: DefaultChain needs an Idempotency guard")
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Recorder != nil {
		if cfg.Poison.Recorder == nil {
			cfg.Poison.Recorder = cfg.Recorder
		}
		if cfg.DurableRetry.Recorder == nil {
			cfg.DurableRetry.Recorder = cfg.Recorder
		}
		if cfg.Idempotency.Recorder == nil {
			cfg.Idempotency.Recorder = cfg.Recorder
		}
		if cfg.Infrastructure.Recorder == nil {
			cfg.Infrastructure.Recorder = cfg.Recorder
		}
	}
	poison, err := cfg.Poison.Middleware(logger)
	if err != nil {
		return nil, err
	}
	durable, err := cfg.DurableRetry.Middleware(logger)
	if err != nil {
		return nil, err
	}
	infra, err := cfg.Infrastructure.Middleware(logger)
	if err != nil {
		return nil, err
	}
	retry, err := cfg.Retry.middleware(logger, cfg.Recorder)
	if err != nil {
		return nil, err
	}
	// The application's logger rides in the message's context from here
	// on (pipeline.Logger): a link or handler of the application logs in
	// the application's format, with the message's fields.
	correlation := func(h message.HandlerFunc) message.HandlerFunc {
		inner := Correlation(h)
		return func(msg *message.Message) ([]*message.Message, error) {
			msg.SetContext(pipeline.ContextWithLogger(msg.Context(), logger))
			return inner(msg)
		}
	}
	chain := Chain{
		// Outermost, so that everything below, the poison queue included,
		// logs and forwards the same correlation id.
		{LinkCorrelation, correlation},
		// Outside both retries: only the error left after the last attempt
		// is poisoned (inside Retry it would poison on the first failure).
		// It acks a message only once the poison store has it.
		{LinkPoison, poison},
		// Outside the quick retries: when a few quick tries did not help,
		// the message is rescheduled durably (backoff, attempt count) and
		// the delivery acked, instead of holding the queue.
		{LinkDurableRetry, durable},
		// Inside the durable retry and the poison link: a failure of
		// Ferry's own infrastructure (the ledger's database gone) is waited
		// out here, for as long as it lasts, and never spends an attempt
		// or reaches the poison store.
		{LinkInfra, infra},
		// Quick retries for blips; Permanent errors and deferrals skip them.
		{LinkRetry, retry},
		// Inside Retry, so a panic becomes an error that is retried and then
		// poisoned instead of killing the process.
		{LinkRecoverer, wmw.Recoverer},
		// Innermost: each attempt is its own ledger transaction around the
		// handler, so a failed attempt leaves no ledger row and a duplicate
		// delivery is acked without running the effect.
		{LinkIdempotency, cfg.Idempotency.Middleware},
	}
	if cfg.Tracing != nil {
		// Right inside correlation: the span covers poisoning and retry
		// scheduling too, and every log line below can carry its trace id.
		if chain, err = chain.InsertAfter(LinkCorrelation, Link{LinkTracing, cfg.Tracing}); err != nil {
			return nil, err
		}
	}
	if cfg.Pause.Source != nil {
		pause, err := cfg.Pause.Middleware(logger)
		if err != nil {
			return nil, err
		}
		// Outermost: a paused message has not started, so no span, attempt,
		// retry or poisoning is counted while it waits.
		chain = append(Chain{{LinkPause, pause}}, chain...)
	}
	if cfg.TracingAttempt != nil {
		return chain.InsertAfter(LinkDurableRetry, Link{LinkTracingAttempt, cfg.TracingAttempt})
	}
	return chain, nil
}
