package pipeline

import (
	"errors"
	"math/rand/v2"
	"time"
)

// Defaults of Backoff: the schedule the outbox article settled on. A broker
// outage of an hour costs a handful of attempts per row, not thousands.
const (
	DefaultBackoffInitial    = 30 * time.Second
	DefaultBackoffMax        = 15 * time.Minute
	DefaultBackoffMultiplier = 2.0
	DefaultBackoffJitter     = 0.2
)

// Backoff is an exponential retry schedule with jitter.
type Backoff struct {
	// Initial is the delay after the first failure. Default 30s.
	Initial time.Duration
	// Max caps the delay. Default 15m.
	Max time.Duration
	// Multiplier scales the delay after each further failure. Default 2.
	Multiplier float64
	// Jitter is the fraction of the delay that is randomised, in [0, 1):
	// the delay falls in [d*(1-Jitter), d]. It spreads the retries of rows
	// that failed together (a broker outage) so they do not return as one
	// thundering herd. Default 0.2; set it negative for none.
	Jitter float64
}

// WithDefaults returns a copy of b with zero fields set to their defaults.
func (b Backoff) WithDefaults() Backoff {
	if b.Initial == 0 {
		b.Initial = DefaultBackoffInitial
	}
	if b.Max == 0 {
		b.Max = DefaultBackoffMax
	}
	if b.Multiplier == 0 {
		b.Multiplier = DefaultBackoffMultiplier
	}
	if b.Jitter == 0 {
		b.Jitter = DefaultBackoffJitter
	}
	if b.Jitter < 0 {
		b.Jitter = 0
	}
	return b
}

// Validate reports every problem of b (after WithDefaults) at once.
func (b Backoff) Validate() error {
	var errs []error
	if b.Initial < 0 {
		errs = append(errs, errors.New("Backoff.Initial must not be negative"))
	}
	if b.Max < b.Initial {
		errs = append(errs, errors.New("Backoff.Max must be at least Backoff.Initial"))
	}
	if b.Multiplier < 1 {
		errs = append(errs, errors.New("Backoff.Multiplier must be at least 1"))
	}
	if b.Jitter >= 1 {
		errs = append(errs, errors.New("Backoff.Jitter must be below 1"))
	}
	return errors.Join(errs...)
}

// Delay returns how long to wait after the given failed attempt (1 for the
// first failure). b is expected to have been through WithDefaults.
func (b Backoff) Delay(attempt int) time.Duration {
	d := float64(b.Initial)
	for i := 1; i < attempt && d < float64(b.Max); i++ {
		d *= b.Multiplier
	}
	d = min(d, float64(b.Max))
	if b.Jitter > 0 {
		d -= d * b.Jitter * rand.Float64()
	}
	return time.Duration(d)
}
