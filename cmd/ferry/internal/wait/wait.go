// Package wait polls a condition for the test rigs (demo, chaos, bench).
package wait

import (
	"context"
	"time"
)

// For polls cond every 20ms until it holds or ctx ends.
func For(ctx context.Context, cond func() bool) error {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
