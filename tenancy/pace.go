package tenancy

import (
	"sync"
	"time"
)

// pace spaces out the backlogs' batches so that the tenants with a few new
// events keep their latency: it watches how long the batches of new events
// take (the database's part and the broker's confirm), learns what that is
// while no backlog runs, and widens the gap between two backlog batches
// while it is over half as long again, narrowing it once it is back.
//
// Why: room at the broker (Config.Room) and lanes of their own keep a
// quiet tenant's event from queueing behind a backlog, but not from
// sharing the machine with it. On two cores, a backlog drained as fast as
// the consumers take it left the machine 97 % busy, and the quiet
// tenants' commit → confirm went from p50 6.8 / p99 33 ms to 49 / 230 ms.
// The drain's rate is whatever leaves them theirs: with a slowdown of 1.5
// their commit → effect p99 was 1.36× of their p99 alone and the backlog
// drained at 120 events/s; with 1.8, 3.4× and 309 events/s (the runs in
// docs/tenants.md).
type pace struct {
	// slowdown is how much slower than without a backlog the new events'
	// batches may get before the backlog's are spaced out more
	// (Config.BacklogSlowdown).
	slowdown float64

	mu sync.Mutex
	// ewma is how long new events' batches took lately, in seconds; base
	// is what it was while no backlog ran (0: not learnt yet).
	ewma, base float64
	// lastBacklog is when a backlog batch last ran: base is learnt only
	// well after.
	lastBacklog time.Time
	gap         time.Duration
	released    time.Time
}

// Bounds of the gap between two backlog batches.
const (
	maxBacklogGap = 2 * time.Second
	minBacklogGap = 2 * time.Millisecond
	// defaultBase stands for base until it is learnt: a fleet that starts
	// with a backlog has never seen the machine without one.
	defaultBase = 20 * time.Millisecond
)

// fresh records how long a batch of new events took.
func (p *pace) fresh(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := d.Seconds()
	switch {
	case p.ewma == 0:
		p.ewma = s
	case s > p.ewma:
		// Up fast, down slowly: the tail is what the tenants feel, and a
		// backlog let go again on the first quiet batch brings it back.
		p.ewma += 0.3 * (s - p.ewma)
	default:
		p.ewma += 0.05 * (s - p.ewma)
	}
	if time.Since(p.lastBacklog) > 5*time.Second {
		// No backlog for a while: this is the machine's own pace.
		if p.base == 0 {
			p.base = p.ewma
		} else {
			p.base += 0.05 * (p.ewma - p.base)
		}
	}
}

// backlogRan notes a backlog batch.
func (p *pace) backlogRan() {
	p.mu.Lock()
	p.lastBacklog = time.Now()
	p.mu.Unlock()
}

// wait is how long the next backlog batch waits yet. Each look adjusts
// the gap to what the new events see now: doubled (up to 2 s) while they
// are slow, a tenth narrower while they are not; the room watch looks
// again after each wait, so a slowdown that lasts widens it quickly.
func (p *pace) wait() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	base := p.base
	if base == 0 {
		base = defaultBase.Seconds()
	}
	if p.ewma > p.slowdown*base {
		p.gap = min(max(p.gap*2, minBacklogGap), maxBacklogGap)
	} else {
		p.gap = p.gap * 9 / 10
		if p.gap < minBacklogGap {
			p.gap = 0
		}
	}
	return time.Until(p.released.Add(p.gap))
}

// release notes that a backlog batch was let go.
func (p *pace) release() {
	p.mu.Lock()
	p.released = time.Now()
	p.mu.Unlock()
}

// snapshot is the pace as the metrics and the bench show it.
func (p *pace) snapshot() (fresh, base, gap time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return time.Duration(p.ewma * float64(time.Second)), time.Duration(p.base * float64(time.Second)), p.gap
}
