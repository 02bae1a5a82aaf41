package middleware

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/sony/gobreaker"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults of BudgetConfig.
const (
	DefaultBreakerFailures    = 5
	DefaultBreakerOpenTimeout = 30 * time.Second
)

// Errors a budget deferral carries (pipeline.Deferred reports the delay).
var (
	ErrBudgetExhausted = errors.New("spend budget exhausted")
	ErrCircuitOpen     = errors.New("circuit breaker open")
)

// Spender takes cost from a shared budget window (pgbudget.Spender is
// Ferry's, shared across processes). ok is false, with the time until the
// next window, when the spend would exceed limit.
type Spender interface {
	Spend(ctx context.Context, budget string, cost, limit int64, window time.Duration) (ok bool, retryAfter time.Duration, err error)
}

// BudgetConfig configures the budget breaker, for handlers that call a paid
// API (an LLM, a card network): a circuit breaker on failures plus a spend
// budget per window. When the circuit is open or the budget spent, the
// message is deferred durably (pipeline.Defer) instead of failed: it comes
// back when the breaker half-opens or the next window starts, without
// using up an attempt, so it never lands in the poison queue for it.
// Every call counts, retries included, so runaway retries cannot overspend.
type BudgetConfig struct {
	// Name identifies the budget; processes with the same name share it. Required.
	Name string
	// Limit is how many cost units one Window may spend. Required.
	Limit int64
	// Window is the budget's period (time.Minute, 24*time.Hour, ...). Required.
	Window time.Duration
	// Cost is what one call of the handler costs. Default: 1 per call.
	Cost func(msg *message.Message) int64
	// Spender keeps the budget. Required.
	Spender Spender
	// BreakerFailures is how many consecutive failures open the circuit.
	// Permanent errors (the provider judged the request) do not count. Default 5.
	BreakerFailures uint32
	// BreakerOpenTimeout is how long the circuit stays open before letting
	// one call through to test the provider. Default 30s.
	BreakerOpenTimeout time.Duration
}

// Budget is a configured budget breaker.
type Budget struct {
	cfg     BudgetConfig
	breaker *gobreaker.CircuitBreaker
	logger  *slog.Logger

	deferredBudget, deferredBreaker atomic.Int64
}

// NewBudget checks cfg and returns the breaker.
func NewBudget(cfg BudgetConfig, logger *slog.Logger) (*Budget, error) {
	var errs []error
	if cfg.Name == "" {
		errs = append(errs, errors.New("BudgetConfig.Name is required"))
	}
	if cfg.Limit <= 0 || cfg.Window <= 0 {
		errs = append(errs, errors.New("BudgetConfig.Limit and Window must be positive"))
	}
	if cfg.Spender == nil {
		errs = append(errs, errors.New("BudgetConfig.Spender is required"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.Cost == nil {
		cfg.Cost = func(*message.Message) int64 { return 1 }
	}
	if cfg.BreakerFailures == 0 {
		cfg.BreakerFailures = DefaultBreakerFailures
	}
	if cfg.BreakerOpenTimeout == 0 {
		cfg.BreakerOpenTimeout = DefaultBreakerOpenTimeout
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	b := &Budget{cfg: cfg, logger: logger}
	b.breaker = gobreaker.NewCircuitBreaker(gobreaker.Settings{
		Name:    cfg.Name,
		Timeout: cfg.BreakerOpenTimeout,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			return c.ConsecutiveFailures >= cfg.BreakerFailures
		},
		IsSuccessful: func(err error) bool {
			// Only the provider's own failures trip the circuit: not a request
			// it judged invalid, not our budget saying no.
			return err == nil || pipeline.IsPermanent(err) || errors.Is(err, ErrBudgetExhausted)
		},
		OnStateChange: func(name string, from, to gobreaker.State) {
			logger.Warn("budget circuit breaker changed state", "budget", name, "from", from.String(), "to", to.String())
		},
	})
	return b, nil
}

// Deferrals returns how many messages were deferred for the budget and for the breaker.
func (b *Budget) Deferrals() (budget, breaker int64) {
	return b.deferredBudget.Load(), b.deferredBreaker.Load()
}

// Middleware is the handler middleware; put it in the Route's Middleware.
func (b *Budget) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		var produced []*message.Message
		var retryAfter time.Duration
		_, err := b.breaker.Execute(func() (any, error) {
			ok, after, err := b.cfg.Spender.Spend(msg.Context(), b.cfg.Name, b.cfg.Cost(msg), b.cfg.Limit, b.cfg.Window)
			if err != nil {
				return nil, err
			}
			if !ok {
				retryAfter = after
				return nil, ErrBudgetExhausted
			}
			var herr error
			produced, herr = h(msg)
			return nil, herr
		})
		switch {
		case errors.Is(err, ErrBudgetExhausted):
			b.deferredBudget.Add(1)
			b.logger.WarnContext(msg.Context(), "message deferred: budget exhausted", "budget", b.cfg.Name, "limit", b.cfg.Limit,
				"window", b.cfg.Window, "retry_in", retryAfter)
			return nil, pipeline.Defer(fmt.Errorf("budget %q: %w", b.cfg.Name, ErrBudgetExhausted), retryAfter)
		case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
			b.deferredBreaker.Add(1)
			b.logger.WarnContext(msg.Context(), "message deferred: circuit open", "budget", b.cfg.Name,
				"retry_in", b.cfg.BreakerOpenTimeout)
			return nil, pipeline.Defer(fmt.Errorf("budget %q: %w", b.cfg.Name, ErrCircuitOpen), b.cfg.BreakerOpenTimeout)
		}
		return produced, err
	}
}
