package metrics

import (
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ageGauge is a gauge vector of ages (a hold's, a pause's). The refresh
// keeps each series' start; a scrape reads now − start, so the age it
// reads is the age at the scrape, as ferry status and the console compute
// it, not the age at the last refresh (up to FERRY_METRICS_REFRESH older).
// A series whose start is gone answers 0 from then on, as setGauges does.
// Written by hand: client_golang's vectors hold values, not clocks.
type ageGauge struct {
	desc *prometheus.Desc
	now  func() time.Time

	mu    sync.Mutex
	since map[string]time.Time // label values joined by labelSep; zero: ended
}

func newAgeGauge(name, help string, labels ...string) *ageGauge {
	return &ageGauge{desc: prometheus.NewDesc(name, help, labels, nil), now: time.Now, since: map[string]time.Time{}}
}

// Describe implements prometheus.Collector.
func (g *ageGauge) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

// Collect implements prometheus.Collector.
func (g *ageGauge) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	for key, start := range g.since {
		v := 0.0
		if !start.IsZero() {
			v = max(now.Sub(start).Seconds(), 0)
		}
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, v, strings.Split(key, labelSep)...)
	}
}

// set replaces the starts: a series not in starts any more answers 0.
func (g *ageGauge) set(starts map[string]time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for key := range g.since {
		if _, ok := starts[key]; !ok {
			g.since[key] = time.Time{}
		}
	}
	for key, start := range starts {
		g.since[key] = start
	}
}
