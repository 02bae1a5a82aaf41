package tenancy

import (
	"context"
	"slices"
	"time"

	"github.com/ferry-dev/ferry/pipeline"
)

// The schedule of a member's tenants: the ready line its workers take
// tenants from, each tenant's timer, and the line of backlogs waiting for
// room at the broker.

// Wake makes tenant id's relay look for work now, if this process serves it.
func (f *Fleet) Wake(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c := f.cells[id]; c != nil {
		f.enqueue(c)
	}
}

// enqueue puts c in the ready line, unless it is there, running (it runs
// again after) or held back by its rate. Call with f.mu held.
func (f *Fleet) enqueue(c *cell) {
	switch {
	case c.stopped || c.queued || c.waiting:
		return
	case c.running:
		c.again = true
		return
	}
	if wait := time.Until(c.notBefore); wait > 0 {
		f.at(c, wait)
		return
	}
	if c.timer != nil {
		c.timer.Stop()
	}
	c.queued = true
	f.ready = append(f.ready, c)
	select {
	case f.signal <- struct{}{}:
	default:
	}
}

// at wakes c after d (the earlier of this and a wake already set wins
// only through enqueue: a timer set later replaces it). Call with f.mu held.
func (f *Fleet) at(c *cell, d time.Duration) {
	if c.timer != nil {
		c.timer.Stop()
	}
	c.timer = time.AfterFunc(d, func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.enqueue(c)
	})
}

// stopCell stops serving c. Call with f.mu held.
func (f *Fleet) stopCell(c *cell) {
	c.stopped = true
	if c.timer != nil {
		c.timer.Stop()
	}
	if c.queued {
		c.queued = false
		f.ready = slices.DeleteFunc(f.ready, func(r *cell) bool { return r == c })
	}
	if c.waiting {
		c.waiting = false
		f.waiting = slices.DeleteFunc(f.waiting, func(r *cell) bool { return r == c })
	}
}

// roomPoll is how often the room watch asks again while backlogs wait and
// the queues are full.
const roomPoll = 20 * time.Millisecond

// watchRoom lets the backlogged tenants go one batch at a time, each when
// the broker's queues have room. A failed look at the queues lets one go:
// the broker out of reach stops the batches anyway, and a relay that
// cannot read a queue's depth must not stop relaying.
func (f *Fleet) watchRoom(ctx context.Context) {
	failures := 0
	for {
		f.mu.Lock()
		n := len(f.waiting)
		f.mu.Unlock()
		if n == 0 {
			select {
			case <-ctx.Done():
				return
			case <-f.roomSignal:
			}
			continue
		}
		room, err := f.cfg.Room(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			failures++
			if failures == 1 || failures%100 == 0 {
				f.logger.Warn("reading the queues' depth failed; backlogs go on without waiting for room", "error", err, "failures", failures)
			}
			room = true
		} else {
			failures = 0
		}
		if !room {
			if pipeline.Sleep(ctx, roomPoll) != nil {
				return
			}
			continue
		}
		if wait := f.pace.wait(); f.cfg.BacklogSlowdown > 0 && wait > 0 {
			if pipeline.Sleep(ctx, wait) != nil {
				return
			}
			continue // the room, again, after the wait
		}
		f.pace.release()
		f.mu.Lock()
		if len(f.waiting) > 0 {
			c := f.waiting[0]
			f.waiting = f.waiting[1:]
			c.waiting = false
			f.enqueue(c)
		}
		f.mu.Unlock()
	}
}

func (f *Fleet) take(ctx context.Context) *cell {
	for {
		f.mu.Lock()
		if len(f.ready) > 0 {
			c := f.ready[0]
			f.ready = f.ready[1:]
			c.queued, c.running = false, true
			more := len(f.ready) > 0
			f.mu.Unlock()
			if more {
				select {
				case f.signal <- struct{}{}:
				default:
				}
			}
			return c
		}
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-f.signal:
		}
	}
}

func (f *Fleet) work(ctx context.Context) {
	for {
		c := f.take(ctx)
		if c == nil {
			return
		}
		next, backlog := f.runBatch(ctx, c)
		f.mu.Lock()
		c.running = false
		switch {
		case c.stopped || ctx.Err() != nil:
		case backlog && f.cfg.Room != nil && f.cfg.BacklogRoom > 0:
			c.again = false
			c.waiting = true
			f.waiting = append(f.waiting, c)
			select {
			case f.roomSignal <- struct{}{}:
			default:
			}
		case c.again || next == 0:
			c.again = false
			f.enqueue(c)
		default:
			f.at(c, next)
		}
		f.mu.Unlock()
	}
}
