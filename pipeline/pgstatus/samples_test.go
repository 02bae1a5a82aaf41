package pgstatus_test

import (
	"context"
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func TestQuantile(t *testing.T) {
	t.Parallel()
	_, ok := pgstatus.Quantile(0.95, nil)
	require.False(t, ok, "an empty histogram has no quantile")
	_, ok = pgstatus.Quantile(0.95, map[float64]float64{0.1: 0, math.Inf(1): 0})
	require.False(t, ok)

	// 100 observations: 90 at or under 10 ms, 10 between 10 ms and 1 s.
	h := map[float64]float64{0.01: 90, 1: 100, math.Inf(1): 100}
	q, ok := pgstatus.Quantile(0.95, h)
	require.True(t, ok)
	require.InDelta(t, 0.01+0.99*0.5, q, 1e-9, "rank 95 is half way through the (0.01, 1] bucket")
	q, _ = pgstatus.Quantile(0.5, h)
	require.InDelta(t, 0.01*50/90, q, 1e-9)

	// Beyond the last finite bound, the bound is the answer (as Prometheus).
	q, _ = pgstatus.Quantile(0.99, map[float64]float64{1: 10, math.Inf(1): 100})
	require.Equal(t, 1.0, q)
}

// Two processes, one of them started in the window, sample their counters
// as heartbeats do; History sums their rates per step and reads the
// latency of each step from the differences of their histograms.
func TestHistorySumsTheProcessesRates(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	var now time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT now()`).Scan(&now))
	step := time.Minute
	if now.Sub(now.Truncate(step)) > 50*time.Second { // the steps must not move under the test
		time.Sleep(step - now.Sub(now.Truncate(step)) + time.Second)
		require.NoError(t, pool.QueryRow(ctx, `SELECT now()`).Scan(&now))
	}
	// The step before the one under way, whole.
	stepStart := now.Truncate(step).Add(-step)

	insert := func(id string, at time.Time, c pgstatus.Counters) {
		t.Helper()
		b, err := json.Marshal(c)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO ferry_samples (instance_id, at, counters) VALUES ($1, $2, $3)`, id, at, b)
		require.NoError(t, err)
	}
	pending := func(v float64) *float64 { return &v }
	// Process a: 600 dispatches over the minute (10/s), all under 10 ms;
	// its base sample is from before the window's step.
	insert("a", stepStart.Add(-time.Second), pgstatus.Counters{Dispatched: 1000, Handled: 50, LatencyLE: map[string]float64{"0.01": 1000, "1": 1000, "+Inf": 1000}, Pending: pending(7)})
	for k := 1; k <= 4; k++ {
		d := float64(150 * k)
		insert("a", stepStart.Add(time.Duration(k)*15*time.Second-time.Second), pgstatus.Counters{
			Dispatched: 1000 + d, Handled: 50, LatencyLE: map[string]float64{"0.01": 1000 + d, "1": 1000 + d, "+Inf": 1000 + d}, Pending: pending(float64(10 * k)),
		})
	}
	// Process b: started half way through the step; handles 60 in 30 s
	// (2/s) and fails 15 (0.5/s), and dispatches 60 slow ones (0.5 s).
	insert("b", stepStart.Add(29*time.Second), pgstatus.Counters{})
	insert("b", stepStart.Add(59*time.Second), pgstatus.Counters{
		Handled: 60, Failed: 15, Dispatched: 60, LatencyLE: map[string]float64{"0.01": 0, "1": 60, "+Inf": 60},
	})

	pts, err := pgstatus.History(ctx, pool, time.Hour, step)
	require.NoError(t, err)
	require.Len(t, pts, 60)
	p := pts[len(pts)-2]
	require.Equal(t, stepStart.Add(step), p.At)
	// a: 600 over the 60 s its samples span in this step; b: 60 over 30 s.
	require.NotNil(t, p.DispatchedPerS)
	require.InDelta(t, 10+2, *p.DispatchedPerS, 1e-9)
	require.InDelta(t, 2, *p.HandledPerS, 1e-9)
	require.InDelta(t, 0.5, *p.FailedPerS, 1e-9)
	require.Equal(t, 6, p.Samples)
	require.NotNil(t, p.Pending)
	require.Equal(t, 40.0, *p.Pending, "the depth is the highest read in the step")
	require.NotNil(t, p.LatencyP95S)
	// 660 dispatches, 600 of them under 10 ms: rank 627 falls in (0.01, 1].
	require.InDelta(t, 0.01+0.99*27/60, *p.LatencyP95S, 1e-9)

	for _, q := range pts[:len(pts)-2] {
		require.Nil(t, q.DispatchedPerS, "no two samples of a process before")
		require.Nil(t, q.LatencyP95S)
	}
	require.Equal(t, now.Truncate(step), pts[len(pts)-1].At.Truncate(step), "the last step is the one under way")

	_, err = pgstatus.History(ctx, pool, time.Minute, time.Hour)
	require.Error(t, err)
}
