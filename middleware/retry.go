package middleware

import (
	"errors"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults of RetryConfig: a few quick tries for blips (a dropped
// connection, a 503), not a way to wait out an outage.
const (
	DefaultRetryMaxRetries      = 3
	DefaultRetryInitialInterval = 100 * time.Millisecond
	DefaultRetryMaxInterval     = 2 * time.Second
	DefaultRetryMultiplier      = 2.0
	DefaultRetryJitter          = 0.2
)

// RetryConfig configures in-process retries (Watermill's Retry middleware).
type RetryConfig struct {
	// MaxRetries is how many times a failed handler is tried again. Default 3;
	// set it negative for none.
	MaxRetries int
	// InitialInterval is the wait before the first retry. Default 100ms.
	InitialInterval time.Duration
	// MaxInterval caps the wait between retries. Default 2s.
	MaxInterval time.Duration
	// Multiplier scales the wait after each retry. Default 2.
	Multiplier float64
	// Jitter randomises each wait by this fraction. Default 0.2.
	Jitter float64
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
// It is idempotent: a negative MaxRetries ("none") stays negative, so
// applying the defaults twice (the app's config, then the chain) never
// turns "none" into the default.
func (c RetryConfig) WithDefaults() RetryConfig {
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultRetryMaxRetries
	}
	if c.InitialInterval == 0 {
		c.InitialInterval = DefaultRetryInitialInterval
	}
	if c.MaxInterval == 0 {
		c.MaxInterval = DefaultRetryMaxInterval
	}
	if c.Multiplier == 0 {
		c.Multiplier = DefaultRetryMultiplier
	}
	if c.Jitter == 0 {
		c.Jitter = DefaultRetryJitter
	}
	return c
}

// Validate reports every problem of c (after WithDefaults) at once.
func (c RetryConfig) Validate() error {
	var errs []error
	if c.InitialInterval <= 0 {
		errs = append(errs, errors.New("RetryConfig.InitialInterval must be positive"))
	}
	if c.MaxInterval < c.InitialInterval {
		errs = append(errs, errors.New("RetryConfig.MaxInterval must be at least InitialInterval"))
	}
	if c.Multiplier < 1 {
		errs = append(errs, errors.New("RetryConfig.Multiplier must be at least 1"))
	}
	if c.Jitter < 0 || c.Jitter >= 1 {
		errs = append(errs, errors.New("RetryConfig.Jitter must be in [0, 1)"))
	}
	return errors.Join(errs...)
}

// Middleware returns Watermill's Retry configured by c. Errors marked
// pipeline.Permanent are not retried (no wait can fix a payload that does
// not decode), nor are deferrals (pipeline.Defer), which the durable retry
// link outside handles, nor infrastructure failures, which the
// infrastructure link outside waits out.
//
// Each retry is logged at WARN on the message's context, so the line
// carries the message's ids like every other line of the chain (Watermill's
// own "Error occurred, retrying" line, which carries none, is not used).
func (c RetryConfig) Middleware(logger *slog.Logger) (message.HandlerMiddleware, error) {
	return c.middleware(logger, nil)
}

func (c RetryConfig) middleware(logger *slog.Logger, rec Recorder) (message.HandlerMiddleware, error) {
	c = c.WithDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	retries := max(c.MaxRetries, 0)
	base := wmw.Retry{
		MaxRetries:          retries,
		InitialInterval:     c.InitialInterval,
		MaxInterval:         c.MaxInterval,
		Multiplier:          c.Multiplier,
		RandomizationFactor: c.Jitter,
		// Each attempt starts from the context the chain gave the message,
		// not one an earlier attempt left behind (watermill#467).
		ResetContextOnRetry: true,
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			r := base
			r.ShouldRetry = func(p wmw.RetryParams) bool {
				_, deferred := pipeline.Deferred(p.Err)
				if pipeline.IsPermanent(p.Err) || deferred || pipeline.IsInfrastructure(p.Err) {
					return false
				}
				if p.RetryNum < retries {
					handler := message.HandlerNameFromCtx(msg.Context())
					recorderOr(rec).Record(pipeline.RouteName(handler), OutcomeRetried)
					logger.WarnContext(msg.Context(), "handler failed; retrying in process",
						"handler", handler, "retry", p.RetryNum+1, "max_retries", retries, "error", pipeline.ErrorText(p.Err, maxLastErrorLength))
				}
				return true
			}
			return r.Middleware(h)(msg)
		}
	}, nil
}
