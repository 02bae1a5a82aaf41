package pipeline_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
)

func TestBackoffDefaultSchedule(t *testing.T) {
	t.Parallel()
	b := pipeline.Backoff{Jitter: -1}.WithDefaults()
	require.NoError(t, b.Validate())

	want := []time.Duration{30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 15 * time.Minute, 15 * time.Minute}
	for i, w := range want {
		require.Equal(t, w, b.Delay(i+1), "attempt %d", i+1)
	}
	require.Equal(t, 15*time.Minute, b.Delay(1000), "a huge attempt count must stay capped")
}

func TestBackoffJitterStaysInBand(t *testing.T) {
	t.Parallel()
	b := pipeline.Backoff{}.WithDefaults()
	seen := map[time.Duration]bool{}
	for range 200 {
		d := b.Delay(2)
		require.GreaterOrEqual(t, d, 48*time.Second)
		require.LessOrEqual(t, d, time.Minute)
		seen[d] = true
	}
	require.Greater(t, len(seen), 1, "jitter must spread the delays")
}

func TestBackoffValidate(t *testing.T) {
	t.Parallel()
	err := pipeline.Backoff{Initial: time.Minute, Max: time.Second, Multiplier: 0.5, Jitter: 1}.Validate()
	require.ErrorContains(t, err, "Backoff.Max")
	require.ErrorContains(t, err, "Backoff.Multiplier")
	require.ErrorContains(t, err, "Backoff.Jitter")
}
