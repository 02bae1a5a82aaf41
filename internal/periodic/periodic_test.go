package periodic_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A service ticks at start when Immediate and then every interval; an
// error repeated at every tick is logged once, its end once; Stop runs
// after the context ends.
func TestServiceTicksLogsChangesAndStops(t *testing.T) {
	var logs pipelinetest.SyncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	errs := []error{errors.New("down"), errors.New("down"), errors.New("down"), nil, nil}
	ticked := make(chan error, 10)
	var n int
	stopped := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	wait := periodic.Start(ctx, logger, periodic.Service{
		Name: "watch", Interval: time.Millisecond, Immediate: true,
		Tick: func(context.Context) error {
			err := errs[min(n, len(errs)-1)]
			n++
			return err
		},
		Stop:   func(context.Context) { close(stopped) },
		Ticked: ticked,
	})
	for i := range len(errs) {
		select {
		case err := <-ticked:
			require.Equal(t, errs[i], err, "tick %d", i)
		case <-time.After(5 * time.Second):
			t.Fatalf("tick %d never came", i)
		}
	}
	cancel()
	wait()
	<-stopped
	require.Equal(t, 1, strings.Count(logs.String(), "watch failed"), logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), "watch recovered"), logs.String())
}

// Without Immediate the first tick waits an interval.
func TestServiceWaitsAnIntervalFirst(t *testing.T) {
	ticked := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	start := time.Now()
	wait := periodic.Start(ctx, nil, periodic.Service{Name: "slow", Interval: 50 * time.Millisecond,
		Tick: func(context.Context) error { return nil }, Ticked: ticked})
	<-ticked
	require.GreaterOrEqual(t, time.Since(start), 50*time.Millisecond)
	cancel()
	wait()
}
