package pipeline

import (
	"context"
	"fmt"
	"time"
)

// A consumer that stops gracefully drains: it hands out no new delivery
// and lets the handlers finish what they hold. Their contexts stay alive
// for that (a cancelled context would cut a handler between its effect and
// its ledger commit, and the message would run twice). What a handler only
// waits for (a held partition's backoff, a database or poison store
// outage) must not hold up the stop, though: such waits watch Stopping,
// and end with ErrStopping.

type stoppingKey struct{}

// ErrStopping is what a link returns when its consumer stops while it
// waits: the delivery goes back to the broker unsettled, first in line, and
// no attempt is spent. It wraps context.Canceled, so every link passes it
// through as it does a cancellation (no retry, no poison).
var ErrStopping = fmt.Errorf("consumer stopping: the message goes back to the broker unsettled: %w", context.Canceled)

// WithStopping returns ctx carrying stop, closed when the consumer that
// delivered the message begins to stop.
func WithStopping(ctx context.Context, stop <-chan struct{}) context.Context {
	return context.WithValue(ctx, stoppingKey{}, stop)
}

// Stopping is the channel closed when the consumer of the message whose
// context this is begins a graceful stop; nil (never ready) when there is
// none.
func Stopping(ctx context.Context) <-chan struct{} {
	stop, _ := ctx.Value(stoppingKey{}).(<-chan struct{})
	return stop
}

// Sleep waits d. It ends early with the context's cause when ctx ends, or
// with ErrStopping when the message's consumer begins to stop: a wait is
// never work a drain should finish.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-Stopping(ctx):
		return ErrStopping
	}
}
