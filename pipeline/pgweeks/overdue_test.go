package pgweeks_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgweeks"
)

// A partition is overdue once a prune with the retention should have
// cleared it a prune interval and OverdueGrace ago; since is when the
// oldest overdue one passed retention. Empty and current partitions, and
// a table with no retention, are never overdue.
func TestOverdueJudgesByRetentionIntervalAndGrace(t *testing.T) {
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	day := 24 * time.Hour
	retention, interval := 30*day, time.Hour
	week := func(name string, until time.Time) pgweeks.Partition {
		return pgweeks.Partition{Name: name, Until: until, From: until.Add(-7 * day)}
	}
	oldest := week("p01", now.Add(-45*day))
	older := week("p02", now.Add(-38*day))
	justPast := week("p03", now.Add(-retention-interval-30*time.Minute)) // within the grace
	recent := week("p04", now.Add(-10*day))
	empty := week("p05", now.Add(-60*day))
	empty.Empty = true
	current := week("p06", now.Add(-50*day))
	current.Current = true
	parts := []pgweeks.Partition{older, justPast, recent, oldest, empty, current}

	late, since := pgweeks.Overdue(parts, now, retention, interval)
	require.Equal(t, []pgweeks.Partition{older, oldest}, late)
	require.Equal(t, oldest.Until.Add(retention), since)

	justPast.Until = now.Add(-retention - interval - pgweeks.OverdueGrace)
	late, _ = pgweeks.Overdue([]pgweeks.Partition{justPast}, now, retention, interval)
	require.Len(t, late, 1, "at the grace's end")

	late, since = pgweeks.Overdue(parts, now, 0, interval)
	require.Empty(t, late, "no retention: not judged")
	require.True(t, since.IsZero())
}
