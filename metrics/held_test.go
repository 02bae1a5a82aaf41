package metrics

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A partition held behind one head after another (each poisoned after its
// attempts, ~7.5 min with the defaults, the next failing 18 s later) is
// one hold: refreshed every 15 s, its seconds count from the first head
// through the gaps between heads; released for longer than heldGap it
// drops to 0, and a later hold starts over.
func TestHeldSecondsCountAcrossHeads(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 3, 0, 0, 0, time.UTC)
	p := "payments.charge@3"
	// The rows the consumers record: head k holds from k*468 s to
	// k*468+450 s; three heads, then the provider is back.
	row := func(at time.Duration) (time.Time, bool) {
		k := at / (468 * time.Second)
		start := k * 468 * time.Second
		if k > 2 || at-start >= 450*time.Second {
			return time.Time{}, false
		}
		return t0.Add(start), true
	}
	var h heldTracker
	end := 3*468*time.Second - 18*time.Second // the last head's release
	for at := 15 * time.Second; at <= end+4*time.Minute; at += 15 * time.Second {
		current := map[string]time.Time{}
		if s, ok := row(at); ok {
			current[p] = s
		}
		v, shown := h.update(t0.Add(at), current)[p]
		switch {
		case at <= end+heldGap:
			require.Equal(t, at.Seconds(), v, "at %s: held since the first head", at)
		case shown:
			require.Zero(t, v, "at %s: released", at)
		}
	}
	require.Equal(t, 30.0, h.update(t0.Add(time.Hour), map[string]time.Time{p: t0.Add(time.Hour - 30*time.Second)})[p], "a new hold starts over")
}
