package metrics

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
)

// The held seconds are the hold's one clock (pgheld's since, across the
// outage's heads), by partition and route; a partition no longer held has
// none (setGauges shows it at 0), so nothing counts on after recovery.
func TestHeldSecondsAreTheHoldsClock(t *testing.T) {
	now := time.Date(2026, 12, 4, 3, 10, 0, 0, time.UTC)
	m := New()
	m.held.now = func() time.Time { return now }
	m.held.set(heldSince([]pgheld.Partition{
		{Consumer: "payments.charge@3", Since: now.Add(-7 * time.Minute)},
		{Consumer: "ledger.post@0", Since: now.Add(-30 * time.Second)},
	}))
	require.Equal(t, map[string]float64{
		"consumer=payments.charge@3 handler=payments.charge": 420,
		"consumer=ledger.post@0 handler=ledger.post":         30,
	}, collected(t, m.held))
	// Read at the scrape: a minute later, a minute older, with no refresh.
	now = now.Add(time.Minute)
	require.Equal(t, 480.0, collected(t, m.held)["consumer=payments.charge@3 handler=payments.charge"])
	// Released: 0 from then on.
	m.held.set(heldSince(nil))
	require.Equal(t, map[string]float64{
		"consumer=payments.charge@3 handler=payments.charge": 0,
		"consumer=ledger.post@0 handler=ledger.post":         0,
	}, collected(t, m.held))
}

// collected is what a scrape of c reads: each series' labels and value.
func collected(t *testing.T, c prometheus.Collector) map[string]float64 {
	t.Helper()
	series := make(chan prometheus.Metric, 100)
	c.Collect(series)
	close(series)
	out := map[string]float64{}
	for s := range series {
		var d dto.Metric
		require.NoError(t, s.Write(&d))
		var labels []string
		for _, l := range d.GetLabel() {
			labels = append(labels, l.GetName()+"="+l.GetValue())
		}
		out[strings.Join(labels, " ")] = d.GetGauge().GetValue()
	}
	return out
}

// Poisonings are counted by route and cause, at most maxCauses causes a
// route (then "other"), so that a flood of distinct reasons cannot grow
// the series without bound.
func TestPoisonCausesAreBounded(t *testing.T) {
	m := New()
	var _ middleware.CauseRecorder = m
	for i := range maxCauses + 5 {
		m.RecordPoisonCause("payments.charge", fmt.Sprint("cause ", i))
	}
	m.RecordPoisonCause("payments.charge", "cause 3")
	m.RecordPoisonCause("mail.send", "SMTP #")
	value := func(handler, cause string) float64 {
		var out dto.Metric
		require.NoError(t, m.poisonCauses.WithLabelValues(handler, cause).Write(&out))
		return out.GetCounter().GetValue()
	}
	require.Equal(t, 1.0, value("mail.send", "SMTP #"))
	require.Equal(t, 2.0, value("payments.charge", "cause 3"))
	require.Equal(t, 5.0, value("payments.charge", "other"))
	series := make(chan prometheus.Metric, 100)
	m.poisonCauses.Collect(series)
	close(series)
	require.Len(t, series, maxCauses+1+1, "20 causes and other for one route, one for the other")
}

// A pause shows its age and its words (who, why, personal data masked)
// while it lasts; once resumed, its age is 0 and its words are gone, so
// the alert's join finds nothing to fire on.
func TestPausesShowTheirAgeAndWordsWhileTheyLast(t *testing.T) {
	m := New()
	now := time.Date(2026, 12, 7, 3, 0, 0, 0, time.UTC)
	m.paused.now = func() time.Time { return now }
	m.setPauses([]pgpause.Pause{{Handler: "payments.charge", At: now.Add(-6 * time.Minute), By: "ops@example.com", Reason: "provider down, see dave.smith@example.com"}})
	require.Equal(t, map[string]float64{"handler=payments.charge": 360}, collected(t, m.paused))
	info := collected(t, m.pauseInfo)
	require.Len(t, info, 1)
	for labels, v := range info {
		require.Equal(t, 1.0, v)
		require.Contains(t, labels, "paused_by=ops@example.com")
		require.Contains(t, labels, "handler=payments.charge")
		require.Contains(t, labels, "reason=provider down, see ")
		require.NotContains(t, labels, "dave.smith", "personal data is masked")
	}

	now = now.Add(time.Minute)
	m.setPauses(nil)
	require.Equal(t, map[string]float64{"handler=payments.charge": 0}, collected(t, m.paused))
	require.Empty(t, collected(t, m.pauseInfo))
}
