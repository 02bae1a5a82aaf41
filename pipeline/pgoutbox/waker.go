package pgoutbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Why not a trigger: a NOTIFY inside the producing transaction (migration
// 00004's trigger, removed by 00018) makes PostgreSQL take one
// instance-wide lock at the commit of every such transaction, so that
// notifications queue in commit order: the application's commits
// serialize behind it (32 writers committed at half the rate). The Waker
// sends the notification after the commit instead, from a connection of
// its own, at most one in flight and one per Interval per process: the
// lock is taken by that tiny transaction alone, never by the
// application's.

// DefaultWakerInterval is the least time between two notifications of one
// process: commits within it share the next one.
const DefaultWakerInterval = 2 * time.Millisecond

// WakerConfig configures a Waker.
type WakerConfig struct {
	// Interval is the least time between two notifications. Default
	// DefaultWakerInterval.
	Interval time.Duration
	// Logger receives the waker's connection losses. Default: discard.
	Logger *slog.Logger
}

// Waker tells the relays, in this process and in others (LISTEN on
// NotifyChannel), that events committed. Commit calls it; Run sends.
type Waker struct {
	pool  *pgxpool.Pool
	cfg   WakerConfig
	kick  chan struct{}
	mu    sync.Mutex
	local []func()
	sent  atomic.Int64

	// running counts the Runs in progress; without one, the first
	// Committed starts one of the Waker's own (lazy), which Close ends:
	// a program that publishes and never calls Run (a producer that
	// only builds an app to publish) still wakes the relays at the
	// commit, instead of leaving them to their probe or sweep.
	running atomic.Int32
	lazy    struct {
		sync.Mutex
		cancel context.CancelFunc
		done   chan struct{}
		closed bool
	}
}

// NewWaker returns a Waker whose notifications go through a connection
// configured as pool's (its schema is the payload, as relays expect).
func NewWaker(pool *pgxpool.Pool, cfg WakerConfig) *Waker {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultWakerInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Waker{pool: pool, cfg: cfg, kick: make(chan struct{}, 1)}
}

// OnCommit adds fn, called at every Committed: a relay in the same
// process wakes without a round trip (Relay.Wake).
func (w *Waker) OnCommit(fn func()) {
	w.mu.Lock()
	w.local = append(w.local, fn)
	w.mu.Unlock()
}

// Committed says events committed. It never blocks: the notification is
// sent by Run, shared with the commits of the next Interval.
func (w *Waker) Committed() {
	w.mu.Lock()
	local := w.local
	w.mu.Unlock()
	for _, fn := range local {
		fn()
	}
	select {
	case w.kick <- struct{}{}:
	default:
	}
	if w.running.Load() == 0 {
		w.startLazy()
	}
}

// startLazy starts the Waker's own Run, unless one runs or it was closed.
func (w *Waker) startLazy() {
	w.lazy.Lock()
	defer w.lazy.Unlock()
	if w.lazy.cancel != nil || w.lazy.closed {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.lazy.cancel, w.lazy.done = cancel, make(chan struct{})
	go func(done chan struct{}) {
		defer close(done)
		_ = w.run(ctx)
	}(w.lazy.done)
}

// stopLazy ends the Waker's own Run, if it started one.
func (w *Waker) stopLazy() {
	w.lazy.Lock()
	cancel, done := w.lazy.cancel, w.lazy.done
	w.lazy.cancel, w.lazy.done = nil, nil
	w.lazy.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// Close ends the Run the Waker started of its own (see Committed); a Run
// of the caller's ends with its context. Committed after Close starts
// nothing.
func (w *Waker) Close() {
	w.lazy.Lock()
	w.lazy.closed = true
	w.lazy.Unlock()
	w.stopLazy()
}

// Sent is how many notifications Run has sent.
func (w *Waker) Sent() int64 {
	return w.sent.Load()
}

// Run sends the notifications until ctx ends (without it, the first
// Committed starts a Run of the Waker's own, which Close ends). A lost connection is
// reconnected after a pause; meanwhile the relays poll, so only latency
// is lost.
func (w *Waker) Run(ctx context.Context) error {
	w.running.Add(1)
	defer w.running.Add(-1)
	w.stopLazy() // one sender per Waker is enough
	return w.run(ctx)
}

func (w *Waker) run(ctx context.Context) error {
	for ctx.Err() == nil {
		err := w.runOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		w.cfg.Logger.Warn("relay waker lost its connection; relays poll until it is back", "error", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	return nil
}

func (w *Waker) runOnce(ctx context.Context) error {
	// A connection of its own, not the pool's: a pool exhausted by the
	// application must not delay the wake-ups, nor they the application.
	conn, err := pgx.ConnectConfig(ctx, w.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var schema string
	if err := conn.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		return fmt.Errorf("reading current schema: %w", err)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-w.kick:
		}
		if _, err := conn.Exec(ctx, `SELECT pg_notify($1, $2)`, NotifyChannel, schema); err != nil {
			select { // not sent: again once reconnected
			case w.kick <- struct{}{}:
			default:
			}
			return err
		}
		w.sent.Add(1)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(w.cfg.Interval):
		}
	}
}
