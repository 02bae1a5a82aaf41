package tenancy

import (
	"testing"
	"time"
)

// The backlogs' gap widens while new events' batches take longer than
// slowdown × what they took without a backlog, and narrows back to none
// once they do not: the drain gives the machine back to them.
func TestPaceSpacesBacklogsOutWhileNewEventsSlowDown(t *testing.T) {
	p := &pace{slowdown: 1.5}
	for range 50 {
		p.fresh(10 * time.Millisecond) // no backlog yet: the machine's pace
	}
	_, base, _ := p.snapshot()
	if base < 9*time.Millisecond || base > 11*time.Millisecond {
		t.Fatalf("base %s, want about 10ms", base)
	}
	if w := p.wait(); w > 0 {
		t.Fatalf("a backlog waits %s while new events keep their pace", w)
	}
	p.backlogRan()
	for range 50 {
		p.fresh(40 * time.Millisecond) // the backlog slows them 4×
	}
	var gaps []time.Duration
	for range 10 {
		p.wait()
		_, _, gap := p.snapshot()
		gaps = append(gaps, gap)
	}
	for i := 1; i < len(gaps); i++ {
		if gaps[i] < gaps[i-1] {
			t.Fatalf("the gap narrowed while new events were slow: %v", gaps)
		}
	}
	if gaps[len(gaps)-1] < 50*time.Millisecond {
		t.Fatalf("the gap stayed at %s", gaps[len(gaps)-1])
	}
	_, base2, _ := p.snapshot()
	if base2 != base {
		t.Fatalf("the base moved to %s beside a backlog", base2)
	}
	for range 50 {
		p.fresh(11 * time.Millisecond) // back within 1.5×
	}
	for range 100 {
		p.wait()
	}
	if _, _, gap := p.snapshot(); gap != 0 {
		t.Fatalf("the gap is %s once new events are back to their pace", gap)
	}
}
