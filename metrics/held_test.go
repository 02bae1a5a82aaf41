package metrics

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgheld"
)

// The held seconds are the hold's one clock (pgheld's since, across the
// outage's heads), by partition and route; a partition no longer held has
// none (setGauges shows it at 0), so nothing counts on after recovery.
func TestHeldSecondsAreTheHoldsClock(t *testing.T) {
	now := time.Date(2026, 12, 4, 3, 10, 0, 0, time.UTC)
	got := heldSeconds(now, []pgheld.Partition{
		{Consumer: "payments.charge@3", Since: now.Add(-7 * time.Minute)},
		{Consumer: "ledger.post@0", Since: now.Add(-30 * time.Second)},
	})
	require.Equal(t, map[string]float64{
		"payments.charge@3" + labelSep + "payments.charge": 420,
		"ledger.post@0" + labelSep + "ledger.post":         30,
	}, got)
	require.Empty(t, heldSeconds(now, nil))
}
