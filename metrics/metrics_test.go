package metrics_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// The counters a heartbeat samples for the console's charts are the
// process's own: what the relay confirmed (and how late), what the
// handlers did, and no outbox depth before one was read.
func TestCountersSumTheProcesssCounters(t *testing.T) {
	t.Parallel()
	m := metrics.New()
	require.Equal(t, pgstatus.Counters{}, m.Counters(), "a new process has counted nothing and read no depth")

	due := time.Now()
	m.ObserveRelay([]pgoutbox.Outcome{
		{Topic: "a", DueAt: due, At: due.Add(3 * time.Millisecond), Attempt: 1},
		{Topic: "b", DueAt: due, At: due.Add(2 * time.Second), Attempt: 1},
		{Topic: "b", Err: errors.New("nack")},
		{Topic: "c", Shadowed: true},
	})
	for _, o := range []middleware.Outcome{middleware.OutcomeHandled, middleware.OutcomeHandled, middleware.OutcomeDuplicate,
		middleware.OutcomeRetryScheduled, middleware.OutcomePoisoned, middleware.OutcomeInfrastructureRetry, middleware.OutcomeDeferred} {
		m.Record("payments.charge", o)
	}
	c := m.Counters()
	require.Equal(t, 2.0, c.Dispatched, "confirmed publishes only")
	require.Equal(t, 3.0, c.Handled, "handled and duplicates")
	require.Equal(t, 3.0, c.Failed, "a partition waiting behind its head is not a failure")
	require.Equal(t, 2.0, c.LatencyLE["+Inf"])
	require.Equal(t, 1.0, c.LatencyLE["0.005"])
	require.Equal(t, 1.0, c.LatencyLE["1"])
	require.Equal(t, 2.0, c.LatencyLE["2.5"])
	require.Nil(t, c.Pending)
}
