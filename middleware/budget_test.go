package middleware_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgbudget"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// On the real shared budget: calls within the window's limit run; the next
// is deferred until the window ends (a deferral, not a failure: no attempt
// spent, never poisoned); consecutive failures open the circuit, and while
// it is open messages are deferred without calling the provider; a
// Permanent error does not count toward opening it.
func TestBudgetDefersPastItsLimitAndWhileTheCircuitIsOpen(t *testing.T) {
	t.Parallel()
	spender, err := pgbudget.New(pipelinetest.Postgres(t))
	require.NoError(t, err)
	budget, err := middleware.NewBudget(middleware.BudgetConfig{Name: "llm", Limit: 2, Window: time.Hour, Spender: spender,
		BreakerFailures: 2, BreakerOpenTimeout: time.Hour}, nil)
	require.NoError(t, err)
	mws := []message.HandlerMiddleware{budget.Middleware}
	var calls atomic.Int64
	ok := func(*message.Message) ([]*message.Message, error) { calls.Add(1); return nil, nil }

	errs := deliver(t, "summarise", mws, ok, message.NewMessage("a", nil), message.NewMessage("b", nil), message.NewMessage("c", nil))
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	delay, deferred := pipeline.Deferred(errs[2])
	require.True(t, deferred, "over the limit: deferred, %v", errs[2])
	require.ErrorIs(t, errs[2], middleware.ErrBudgetExhausted)
	require.Greater(t, delay, time.Duration(0))
	require.LessOrEqual(t, delay, time.Hour)
	require.Equal(t, int64(2), calls.Load(), "no paid call beyond the limit")
	spent, _ := budget.Deferrals()
	require.Equal(t, int64(1), spent)

	breaker, err := middleware.NewBudget(middleware.BudgetConfig{Name: "cards", Limit: 100, Window: time.Hour, Spender: spender,
		BreakerFailures: 2, BreakerOpenTimeout: time.Hour}, nil)
	require.NoError(t, err)
	var provider atomic.Int64
	failing := func(m *message.Message) ([]*message.Message, error) {
		provider.Add(1)
		if m.UUID == "invalid" {
			return nil, pipeline.Permanent(errors.New("400 invalid request"))
		}
		return nil, errors.New("provider 503")
	}
	errs = deliver(t, "charge", []message.HandlerMiddleware{breaker.Middleware}, failing,
		message.NewMessage("invalid", nil), message.NewMessage("invalid", nil), message.NewMessage("x", nil), message.NewMessage("y", nil), message.NewMessage("z", nil))
	require.True(t, pipeline.IsPermanent(errs[0]))
	require.True(t, pipeline.IsPermanent(errs[1]), "permanent errors leave the circuit closed")
	require.Error(t, errs[2])
	require.Error(t, errs[3])
	_, deferred = pipeline.Deferred(errs[4])
	require.True(t, deferred, "two failures opened the circuit: %v", errs[4])
	require.ErrorIs(t, errs[4], middleware.ErrCircuitOpen)
	require.Equal(t, int64(4), provider.Load(), "the open circuit called nobody")
}
