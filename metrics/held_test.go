package metrics

import (
	"fmt"
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
	m.setPauses(now, []pgpause.Pause{{Handler: "payments.charge", At: now.Add(-6 * time.Minute), By: "ops@example.com", Reason: "provider down, see dave.smith@example.com"}})
	age := func() float64 {
		var out dto.Metric
		require.NoError(t, m.paused.WithLabelValues("payments.charge").Write(&out))
		return out.GetGauge().GetValue()
	}
	require.Equal(t, 360.0, age())
	info := func() []string {
		series := make(chan prometheus.Metric, 10)
		m.pauseInfo.Collect(series)
		close(series)
		var out []string
		for s := range series {
			var d dto.Metric
			require.NoError(t, s.Write(&d))
			var labels []string
			for _, l := range d.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			out = append(out, fmt.Sprint(labels))
		}
		return out
	}
	got := info()
	require.Len(t, got, 1)
	require.Contains(t, got[0], "paused_by=ops@example.com")
	require.Contains(t, got[0], "handler=payments.charge")
	require.Contains(t, got[0], "reason=provider down, see ")
	require.NotContains(t, got[0], "dave.smith", "personal data is masked")

	m.setPauses(now.Add(time.Minute), nil)
	require.Zero(t, age())
	require.Empty(t, info())
}
