package tenancy

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// listeners hold one LISTEN connection per database the served tenants
// live in, not one per tenant: the producers' wake-up (pgoutbox.Waker)
// names the schema whose outbox took rows, and one connection hears every
// schema of its database. 300 tenants as schemas of one database cost one
// connection, asleep in the server until a commit; a relay per tenant
// would hold 300, each with its own LISTEN.
type listeners struct {
	wake   func(tenant string)
	logger *slog.Logger

	mu sync.Mutex
	m  map[string]*listener // by the database's URL, expanded
}

type listener struct {
	cancel context.CancelFunc
	done   chan struct{}
	// schemas maps a NOTIFY payload (a schema) to the tenants with their
	// outbox there; "" holds the tenants on the database's default
	// search_path, resolved once connected.
	schemas atomic.Pointer[map[string][]string]
	// pid is its session's backend while it listens, read only by the
	// test of the retry wait, which terminates that session.
	pid atomic.Uint32
}

func newListeners(wake func(string), logger *slog.Logger) *listeners {
	return &listeners{wake: wake, logger: logger, m: map[string]*listener{}}
}

// set makes the listeners those of byURL (database URL → schema → tenant
// ids): new databases get a connection, databases no served tenant is in
// any more lose theirs.
func (ls *listeners) set(ctx context.Context, byURL map[string]map[string][]string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for url, l := range ls.m {
		if _, ok := byURL[url]; !ok {
			l.cancel()
			<-l.done
			delete(ls.m, url)
		}
	}
	for url, schemas := range byURL {
		l := ls.m[url]
		if l == nil {
			lctx, cancel := context.WithCancel(ctx)
			l = &listener{cancel: cancel, done: make(chan struct{})}
			l.schemas.Store(&schemas)
			ls.m[url] = l
			go func() {
				defer close(l.done)
				ls.run(lctx, url, l)
			}()
			continue
		}
		l.schemas.Store(&schemas)
	}
}

func (ls *listeners) stop() {
	ls.set(context.Background(), nil)
}

func (ls *listeners) count() int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return len(ls.m)
}

// run keeps the database's LISTEN connection up; while it is down the
// fleet's sweeps find the commits, later. The wait between tries doubles
// while the database refuses, and starts again from a second once a
// connection listened: a session terminated now and then must not leave
// the fleet sweeping for 30 s after each (it did, and a chaos run's
// charges waited up to the 2 s sweep).
func (ls *listeners) run(ctx context.Context, url string, l *listener) {
	wait := time.Second
	for ctx.Err() == nil {
		listened, err := ls.listenOnce(ctx, url, l)
		if ctx.Err() != nil {
			return
		}
		if listened {
			wait = time.Second
		}
		ls.logger.Warn("tenant wake-up listener lost; the tenants of this database are swept until it is back",
			"database", pgdb.Redact(url), "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
	}
}

// listenOnce listens on url until its connection fails; listened says
// whether it got as far as listening.
func (ls *listeners) listenOnce(ctx context.Context, url string, l *listener) (listened bool, err error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return listened, err
	}
	cfg.RuntimeParams["application_name"] = "ferry-tenants-listen"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return listened, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var home string
	if err := conn.QueryRow(ctx, `SELECT coalesce(current_schema(), '')`).Scan(&home); err != nil {
		return false, fmt.Errorf("reading the default schema: %w", err)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgoutbox.NotifyChannel); err != nil {
		return false, fmt.Errorf("LISTEN %s: %w", pgoutbox.NotifyChannel, err)
	}
	listened = true
	l.pid.Store(conn.PgConn().PID())
	// Rows committed before LISTEN took effect.
	for _, ids := range *l.schemas.Load() {
		for _, id := range ids {
			ls.wake(id)
		}
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return listened, err
		}
		schemas := *l.schemas.Load()
		if n.Payload == "" {
			for _, ids := range schemas {
				for _, id := range ids {
					ls.wake(id)
				}
			}
			continue
		}
		for _, id := range schemas[n.Payload] {
			ls.wake(id)
		}
		if n.Payload == home {
			for _, id := range schemas[""] {
				ls.wake(id)
			}
		}
	}
}
