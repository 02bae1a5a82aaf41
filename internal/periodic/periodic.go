// Package periodic runs Ferry's background loops in one shape, as River
// runs its maintenance services: a named service whose Tick runs at start
// (Immediate) and then every Interval until its context ends. Its errors
// are logged when they change, not at every tick (an outage repeats one
// error every tick for as long as it lasts), and each tick is signalled to
// a test that waits for it, instead of the test sleeping.
//
// Written here, not taken from a library: the loops need nothing but a
// ticker, and the logging and signalling rules are Ferry's.
package periodic

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Service is one background loop.
type Service struct {
	// Name says which loop, in its log lines ("service").
	Name string
	// Interval is the time between ticks. Required (positive).
	Interval time.Duration
	// Immediate runs the first tick at start, not after an Interval.
	Immediate bool
	// Tick does one round of the loop's work. An error is logged (when it
	// differs from the last one logged) and the loop goes on.
	Tick func(ctx context.Context) error
	// Stop, if set, runs once ctx ended, with a context of its own bounded
	// by StopTimeout (the heartbeat removes its row).
	Stop func(ctx context.Context)
	// ErrorMessage is the log message of a failed tick. Default: Name + "
	// failed".
	ErrorMessage string
	// Ticked, if set, is sent each tick's error (nil for success) without
	// blocking: a test waits on it for a round instead of sleeping.
	Ticked chan<- error
}

// StopTimeout bounds Service.Stop.
const StopTimeout = 5 * time.Second

// Run runs s until ctx ends.
func (s Service) Run(ctx context.Context, logger *slog.Logger) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("service", s.Name)
	msg := s.ErrorMessage
	if msg == "" {
		msg = s.Name + " failed"
	}
	var last string
	tick := func() {
		err := s.Tick(ctx)
		if ctx.Err() != nil {
			return
		}
		switch {
		case err != nil && err.Error() != last:
			logger.Warn(msg, "error", err)
			last = err.Error()
		case err == nil && last != "":
			logger.Info(s.Name + " recovered")
			last = ""
		}
		if s.Ticked != nil {
			select {
			case s.Ticked <- err:
			default:
			}
		}
	}
	if s.Immediate {
		tick()
	}
	t := time.NewTicker(s.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if s.Stop != nil {
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), StopTimeout)
				s.Stop(sctx)
				cancel()
			}
			return
		case <-t.C:
			tick()
		}
	}
}

// Start runs each service on a goroutine of its own until ctx ends; wait
// returns once all have stopped.
func Start(ctx context.Context, logger *slog.Logger, services ...Service) (wait func()) {
	var wg sync.WaitGroup
	for _, s := range services {
		wg.Go(func() { s.Run(ctx, logger) })
	}
	return wg.Wait
}
