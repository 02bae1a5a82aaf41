package middleware

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
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
	// unreachable is the last read's failure when it says that this
	// process cannot reach the database (no answer in time, no
	// connection), nil otherwise.
	unreachable error
}

// pauseReadTimeout bounds one read of the paused routes: a simple read of
// a small table, so a database that has not answered by then is out of
// reach from this process (a black hole, a link down).
const pauseReadTimeout = 3 * time.Second

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
	w.refresh(ctx)
	return w.routes[route]
}

// Unreachable returns, as of the last read, why this process cannot reach
// the database the paused routes are read from (the read timed out or
// found no connection), or nil. The consumers step aside while it is not
// nil (rabbit.ConsumerConfig.StepAside): a handler here could not reach
// its ledger either, and would hold its delivery, and an ordered
// partition, that a process which can reach the database would handle.
func (w *PauseWatch) Unreachable(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.refresh(ctx)
	return w.unreachable
}

// refresh reads the paused routes once they are a Poll old; w.mu is held.
func (w *PauseWatch) refresh(ctx context.Context) {
	if time.Since(w.at) < w.poll {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pauseReadTimeout)
	routes, err := w.src.Paused(rctx)
	if err != nil && rctx.Err() == nil {
		// Once more, on another connection, within the same bound: a
		// pooled connection whose backend was terminated fails once.
		routes, err = w.src.Paused(rctx)
	}
	cancel()
	w.at = time.Now()
	if err != nil {
		// Keep what was known: an outage neither pauses nor resumes.
		w.logger.WarnContext(ctx, "cannot read the paused handlers; keeping the last known", "error", pipeline.ErrorText(err, 300))
		if out := outOfReach(err); out && w.unreachable == nil {
			w.unreachable = err
			w.logger.WarnContext(ctx, "the database does not answer this process; its consumers step aside until it does", "error", pipeline.ErrorText(err, 300))
		}
		return
	}
	w.routes = routes
	if w.unreachable != nil {
		w.unreachable = nil
		w.logger.InfoContext(ctx, "the database answers this process again; its consumers take deliveries")
	}
}

// outOfReach reports whether err says the server could not be reached or
// did not answer in time, rather than that it answered with an error (a
// backend terminated by an administrator answers, and another connection
// will do).
func outOfReach(err error) bool {
	var netErr net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &netErr)
}
