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
// its order and the broker keeps the rest) until the route is resumed. A
// consumer that stops meanwhile gives the delivery back.
type PauseConfig struct {
	// Source reads the paused routes. Required.
	Source PauseSource
	// Poll is how often the paused routes are read (once per process, not
	// per message), and so how soon a pause or a resume takes effect.
	// Default 2s.
	Poll time.Duration
}

// DefaultPausePoll is PauseConfig.Poll's default.
const DefaultPausePoll = 2 * time.Second

// Middleware returns the pause link.
func (c PauseConfig) Middleware(logger *slog.Logger) (message.HandlerMiddleware, error) {
	if c.Source == nil {
		return nil, errors.New("middleware: the pause link needs a Source")
	}
	if c.Poll == 0 {
		c.Poll = DefaultPausePoll
	}
	if c.Poll < 0 {
		return nil, errors.New("middleware: the pause link's Poll must be positive")
	}
	w := &pauseWatch{src: c.Source, poll: c.Poll, logger: logger}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			route := pipeline.RouteName(message.HandlerNameFromCtx(ctx))
			logged := false
			for w.paused(ctx, route) {
				if !logged {
					logger.InfoContext(ctx, "handler paused by an operator; the message waits", "handler", route, "message_id", pipeline.MessageID(msg))
					logged = true
				}
				if err := pipeline.Sleep(ctx, c.Poll); err != nil {
					return nil, err
				}
			}
			return h(msg)
		}
	}, nil
}

// pauseWatch caches the paused routes for Poll: every message asks, one
// query per Poll answers.
type pauseWatch struct {
	src    PauseSource
	poll   time.Duration
	logger *slog.Logger

	mu     sync.Mutex
	at     time.Time
	routes map[string]bool
}

func (w *pauseWatch) paused(ctx context.Context, route string) bool {
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
