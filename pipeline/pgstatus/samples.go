package pgstatus

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Counters is what one process has counted since it started, sampled with
// its heartbeat into ferry_samples (migration 00017) for the console's
// charts. Cumulative, so that a lost sample loses no event: the next
// difference covers it.
type Counters struct {
	// Dispatched is the outbox rows the broker confirmed.
	Dispatched float64 `json:"dispatched"`
	// LatencyLE is the dispatch latency histogram (from when a row became
	// due): cumulative counts by upper bound in seconds, "+Inf" for all.
	LatencyLE map[string]float64 `json:"latency_le,omitempty"`
	// Handled is the deliveries a handler completed (duplicates included).
	Handled float64 `json:"handled"`
	// Failed is the deliveries a handler failed (retried, rescheduled,
	// poisoned; an infrastructure outage included).
	Failed float64 `json:"failed"`
	// Pending is the outbox depth this process last read (nil: it reads none).
	Pending *float64 `json:"pending,omitempty"`
}

// SampleInterval is how often a heartbeat samples its process's counters.
const SampleInterval = 15 * time.Second

// sampleRetention bounds ferry_samples: the charts show one hour.
const sampleRetention = 2 * time.Hour

// sample appends the counters, when due. A failure is not the heartbeat's:
// a schema without ferry_samples (migrations not yet run) still beats.
func (h *Heartbeat) sample(ctx context.Context) {
	if h.Counters == nil || time.Since(h.lastSample) < SampleInterval {
		return
	}
	h.lastSample = time.Now()
	_, _ = h.pool.Exec(ctx, `WITH gone AS (DELETE FROM ferry_samples WHERE at < now() - $3 * interval '1 second')
		INSERT INTO ferry_samples (instance_id, counters) VALUES ($1, $2)`, h.id, h.Counters(), sampleRetention.Seconds())
}

// Point is one step of the charts' history. Rates are per second over the
// step; a nil pointer is a step with nothing to say: no process sampled
// twice in it (rates), read the depth, or dispatched anything (latency).
type Point struct {
	At             time.Time `json:"at"` // the step's end
	Samples        int       `json:"samples"`
	Pending        *float64  `json:"pending,omitempty"`
	DispatchedPerS *float64  `json:"dispatched_per_second,omitempty"`
	LatencyP95S    *float64  `json:"dispatch_latency_p95_seconds,omitempty"`
	HandledPerS    *float64  `json:"handled_per_second,omitempty"`
	FailedPerS     *float64  `json:"failed_per_second,omitempty"`
}

func add(p **float64, v float64) {
	if *p == nil {
		*p = new(float64)
	}
	**p += v
}

// History returns the last window of the pipeline in steps of step,
// oldest first, the step under way last, from every process's samples:
// each process's rate over a step is the difference of its cumulative
// counters divided by the time those samples span, and the rates of the
// processes are summed.
func History(ctx context.Context, pool *pgxpool.Pool, window, step time.Duration) ([]Point, error) {
	pts, _, err := history(ctx, pool, window, step)
	return pts, err
}

// DispatchP95 is the 95th percentile, in seconds, of the dispatch latency
// (from when a row was due to the broker's confirm) over the last window,
// from the relays' samples; nil when none dispatched in it. The relay
// records no dispatch time per row (see pgoutbox's lanes), so the samples
// are where latency is kept.
func DispatchP95(ctx context.Context, pool *pgxpool.Pool, window time.Duration) (*float64, error) {
	_, all, err := history(ctx, pool, window, SampleInterval)
	if err != nil {
		return nil, err
	}
	if q, ok := Quantile(0.95, all); ok {
		return &q, nil
	}
	return nil, nil
}

// history is History, and the latency histogram of the whole window.
func history(ctx context.Context, pool *pgxpool.Pool, window, step time.Duration) ([]Point, map[float64]float64, error) {
	if step <= 0 || window < step {
		return nil, nil, fmt.Errorf("pgstatus: History needs 0 < step <= window, got %s and %s", step, window)
	}
	var now time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return nil, nil, fmt.Errorf("reading samples: %w", err)
	}
	n := int(window / step)
	end := now.Truncate(step).Add(step)
	start := end.Add(-time.Duration(n) * step)
	// One sample before the window, per process, so the window's first
	// difference has a base.
	rows, err := pool.Query(ctx, `SELECT instance_id, at, counters FROM ferry_samples
		WHERE at > $1::timestamptz - $2 * interval '1 second' ORDER BY instance_id, at`, start, (2 * SampleInterval).Seconds())
	if err != nil {
		return nil, nil, fmt.Errorf("reading samples: %w", err)
	}
	defer rows.Close()
	pts := make([]Point, n)
	latency := make([]map[float64]float64, n)
	for i := range pts {
		pts[i].At = start.Add(time.Duration(i+1) * step)
	}
	pts[n-1].At = now
	// One process's differences within one step, until it moves on.
	type acc struct {
		i                         int
		secs                      float64
		dispatched, handled, fail float64
	}
	var cur acc
	flush := func() {
		if cur.secs > 0 && cur.i >= 0 && cur.i < n {
			add(&pts[cur.i].DispatchedPerS, cur.dispatched/cur.secs)
			add(&pts[cur.i].HandledPerS, cur.handled/cur.secs)
			add(&pts[cur.i].FailedPerS, cur.fail/cur.secs)
		}
		cur = acc{i: -1}
	}
	cur.i = -1
	var prevID string
	var prev *Counters
	var prevAt time.Time
	for rows.Next() {
		var id string
		var at time.Time
		var c Counters
		if err := rows.Scan(&id, &at, &c); err != nil {
			return nil, nil, err
		}
		if id != prevID {
			flush()
			prev, prevID = nil, id
		}
		i := int(at.Sub(start) / step)
		if at.Before(start) {
			i = -1
		}
		if i != cur.i {
			flush()
			cur.i = i
		}
		if i >= 0 && i < n {
			pts[i].Samples++
			if c.Pending != nil {
				p := max(deref(pts[i].Pending), *c.Pending)
				pts[i].Pending = &p
			}
			if prev != nil {
				cur.secs += at.Sub(prevAt).Seconds()
				cur.dispatched += max(c.Dispatched-prev.Dispatched, 0)
				cur.handled += max(c.Handled-prev.Handled, 0)
				cur.fail += max(c.Failed-prev.Failed, 0)
				for le, v := range c.LatencyLE {
					b, err := strconv.ParseFloat(le, 64)
					if err != nil {
						continue
					}
					if latency[i] == nil {
						latency[i] = map[float64]float64{}
					}
					latency[i][b] += max(v-prev.LatencyLE[le], 0)
				}
			}
		}
		prev, prevAt = &c, at
	}
	flush()
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("reading samples: %w", err)
	}
	all := map[float64]float64{}
	for i := range pts {
		if q, ok := Quantile(0.95, latency[i]); ok {
			pts[i].LatencyP95S = &q
		}
		for b, v := range latency[i] {
			all[b] += v
		}
	}
	return pts, all, nil
}

func deref(p *float64) float64 {
	if p == nil {
		return 0
	}
	return *p
}

// Quantile estimates the q-quantile of a histogram given as cumulative
// counts by upper bound (+Inf for all), interpolating linearly within the
// bucket it falls in, as Prometheus's histogram_quantile does; in the +Inf
// bucket it answers the highest finite bound. False when it holds nothing.
func Quantile(q float64, cumulative map[float64]float64) (float64, bool) {
	bounds := make([]float64, 0, len(cumulative))
	for b := range cumulative {
		bounds = append(bounds, b)
	}
	slices.Sort(bounds)
	if len(bounds) == 0 {
		return 0, false
	}
	total := cumulative[bounds[len(bounds)-1]]
	if total <= 0 {
		return 0, false
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for _, b := range bounds {
		c := cumulative[b]
		if c >= rank {
			if math.IsInf(b, 1) {
				return lower, true
			}
			if c == below {
				return b, true
			}
			return lower + (b-lower)*(rank-below)/(c-below), true
		}
		lower, below = b, c
	}
	return lower, true
}
