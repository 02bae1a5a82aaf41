package cutoff_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/adoption/cutoff"
)

func TestOutboxedRoutesByDate(t *testing.T) {
	t.Parallel()
	cut := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	topics, err := cutoff.ParseTopics("mail.send=2026-12-01T00:00:00Z, stripe.charge=2027-01-01T00:00:00Z")
	require.NoError(t, err)
	var logs bytes.Buffer
	reg := prometheus.NewRegistry()
	c, err := cutoff.New(cutoff.Config{Topics: topics}, reg, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	require.NoError(t, err)
	ctx := context.Background()
	require.True(t, c.Outboxed(ctx, "mail.send", "o-1", cut), "at the cut-off: outbox")
	require.True(t, c.Outboxed(ctx, "mail.send", "o-2", cut.Add(time.Hour)))
	require.False(t, c.Outboxed(ctx, "mail.send", "o-0", cut.Add(-time.Second)), "before: legacy")
	require.False(t, c.Outboxed(ctx, "stripe.charge", "o-2", cut.Add(time.Hour)), "its own cut-off")
	require.True(t, c.Outboxed(ctx, "other.topic", "o-0", time.Time{}), "no cut-off: outbox")
	require.True(t, c.Outboxed(ctx, "mail.send", "o-1", cut))
	require.Equal(t, 3.0, counter(t, reg, "mail.send", cutoff.PathOutbox))
	require.Equal(t, 1.0, counter(t, reg, "mail.send", cutoff.PathLegacy))
	require.Equal(t, 1.0, counter(t, reg, "stripe.charge", cutoff.PathLegacy))
	require.Equal(t, 1, strings.Count(logs.String(), "aggregate_id=o-1"), "logged once per aggregate")

	_, err = cutoff.ParseTopics("mail.send=yesterday")
	require.Error(t, err)
	_, err = cutoff.ParseTopics("=2026-12-01T00:00:00Z")
	require.Error(t, err)
}

func counter(t *testing.T, reg *prometheus.Registry, topic, path string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "ferry_cutoff_decisions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["topic"] == topic && labels["path"] == path {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
