package middleware

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// LinkPause is the chain's pause link (PauseConfig).
const LinkPause = "pause"

// PauseSource says which routes an operator paused (pgpause.Source).
type PauseSource interface {
	Paused(ctx context.Context) (map[string]bool, error)
}

// PauseConfig configures the pause link: a message of a paused route waits
// before anything runs (its delivery unacked, so an ordered partition keeps
// its order and the broker keeps the rest) until the route is resumed, or
// until its consumer stops or detaches (pipeline.Stopping: a consumer
// asking the same PauseWatch, rabbit.ConsumerConfig.Paused, detaches from
// a paused route within a Poll, and the delivery goes back to wait at the
// broker, where nothing holds it unacked).
type PauseConfig struct {
	// Source reads the paused routes. Required unless Watch is set.
	Source PauseSource
	// Poll is how often the paused routes are read (once per process, not
	// per message), and so how soon a pause or a resume takes effect.
	// Default 2s.
	Poll time.Duration
	// Watch, if set, is the process's one reader of the paused routes,
	// shared with its consumers (NewPauseWatch); Source and Poll are then
	// its own.
	Watch *PauseWatch
}

// DefaultPausePoll is PauseConfig.Poll's default.
const DefaultPausePoll = 2 * time.Second

// Middleware returns the pause link.
func (c PauseConfig) Middleware(logger *slog.Logger) (message.HandlerMiddleware, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	w := c.Watch
	if w == nil {
		var err error
		if w, err = NewPauseWatch(c.Source, c.Poll, logger); err != nil {
			return nil, err
		}
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			route := pipeline.RouteName(message.HandlerNameFromCtx(ctx))
			logged := false
			for w.Paused(ctx, route) {
				if !logged {
					logger.InfoContext(ctx, "handler paused by an operator; the message waits", "handler", route, "message_id", pipeline.MessageID(msg))
					logged = true
				}
				if err := pipeline.Sleep(ctx, w.poll); err != nil {
					return nil, err
				}
			}
			return h(msg)
		}
	}, nil
}

// PauseWatch caches the paused routes for a Poll: every message and every
// consumer asks, one query per Poll answers.
type PauseWatch struct {
	src    PauseSource
	poll   time.Duration
	logger *slog.Logger

	mu     sync.Mutex
	at     time.Time
	routes map[string]bool
}

// NewPauseWatch returns a reader of src's paused routes, read at most once
// per poll (0: DefaultPausePoll).
func NewPauseWatch(src PauseSource, poll time.Duration, logger *slog.Logger) (*PauseWatch, error) {
	if src == nil {
		return nil, errors.New("middleware: the pause link needs a Source")
	}
	if poll == 0 {
		poll = DefaultPausePoll
	}
	if poll < 0 {
		return nil, errors.New("middleware: the pause link's Poll must be positive")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &PauseWatch{src: src, poll: poll, logger: logger}, nil
}

// Poll is how often the watch reads the paused routes.
func (w *PauseWatch) Poll() time.Duration { return w.poll }

// Paused says whether route is paused, as last read (a failed read keeps
// what was known: an outage neither pauses nor resumes).
func (w *PauseWatch) Paused(ctx context.Context, route string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if time.Since(w.at) >= w.poll {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		routes, err := w.src.Paused(rctx)
		cancel()
		if err != nil {
			// Keep what was known: an outage neither pauses nor resumes.
			w.logger.WarnContext(ctx, "cannot read the paused handlers; keeping the last known", "error", pipeline.ErrorText(err, 300))
		} else {
			w.routes = routes
		}
		w.at = time.Now()
	}
	return w.routes[route]
}
