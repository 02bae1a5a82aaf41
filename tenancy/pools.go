package tenancy

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
)

// Defaults of PoolsConfig.
const (
	// DefaultTenantMaxConns is one database's pool, shared by the tenants
	// whose schemas are in it: a fleet member's relay workers and its
	// consumers' transactions at once.
	DefaultTenantMaxConns = 16
	// DefaultTenantIdleAfter is shorter than the sweep (DefaultSweep), so
	// that a database whose tenants are all idle holds no connection
	// between two sweeps.
	DefaultTenantIdleAfter = 10 * time.Second
	// DefaultTenantConnBudget leaves a server of max_connections 100 room
	// for the control database's pool (24) and another member's budget.
	DefaultTenantConnBudget = 40
)

// PoolsConfig bounds the connections the fleet opens to tenants' databases.
type PoolsConfig struct {
	// ControlURL is the control database, where a tenant registered without
	// a database URL lives (a tenant per schema).
	ControlURL string
	// MaxConns is the most connections one process opens to one tenant
	// database, shared by the tenants whose schemas are in it. Default 16.
	MaxConns int32
	// IdleAfter closes a connection once it has been idle this long, so
	// that the databases whose tenants are idle hold none. Default 10s.
	IdleAfter time.Duration
	// Budget bounds the connections this process holds to all tenants'
	// databases together. A connection beyond it first closes the idle
	// connections of the database used least recently; when none is idle
	// it waits up to 5 s for one to be, then fails (a relay batch tries
	// again later; a handler's event waits). Default 40.
	Budget int
	// ApplicationName shows in the tenants' pg_stat_activity. Default
	// "ferry-tenants".
	ApplicationName string
	// Configure, if set, adjusts each database's pool configuration last
	// (the fleet watches commits with it).
	Configure func(cfg *pgxpool.Config)
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c PoolsConfig) WithDefaults() PoolsConfig {
	if c.MaxConns == 0 {
		c.MaxConns = DefaultTenantMaxConns
	}
	if c.IdleAfter == 0 {
		c.IdleAfter = DefaultTenantIdleAfter
	}
	if c.ApplicationName == "" {
		c.ApplicationName = "ferry-tenants"
	}
	if c.Budget == 0 {
		c.Budget = DefaultTenantConnBudget
	}
	return c
}

// Validate reports every problem of c at once.
func (c PoolsConfig) Validate() error {
	var errs []error
	if c.MaxConns < 1 {
		errs = append(errs, fmt.Errorf("PoolsConfig.MaxConns must be positive, got %d", c.MaxConns))
	}
	if c.IdleAfter < time.Second {
		errs = append(errs, fmt.Errorf("PoolsConfig.IdleAfter must be at least 1s, got %s", c.IdleAfter))
	}
	if c.Budget < 1 {
		errs = append(errs, fmt.Errorf("PoolsConfig.Budget must be positive, got %d", c.Budget))
	}
	return errors.Join(errs...)
}

// Pools are the tenants' connections: one pool per database, shared by
// the tenants whose schemas are in it. Each use names its tenant in its
// context (For), and the connection it gets has that tenant's schema for
// its search_path, set when the connection last served another.
//
// A pool per tenant was the first design. With a tenant per schema, 100
// tenants with an event a second each kept 40 connections (the budget)
// opening and closing: their commit → effect p50 was 1.4 s and the
// relays drained a backlog beside them at 51 events/s (docs/bench,
// issue52-tenants-pool-per-tenant). A database's connections serve all its
// schemas; changing a connection's schema costs a SET (PostgreSQL plans a
// prepared statement again when the search_path changed since).
//
// A use without a tenant in its context is refused, never served with the
// schema the connection had: that is how one tenant's write would land in
// another's tables.
type Pools struct {
	cfg PoolsConfig
	mu  sync.Mutex
	m   map[string]*dbPool // by the database's URL, expanded
}

type dbPool struct {
	url  string
	pool *pgxpool.Pool
	// opening is closed once pool (or err) is set: one dial per database
	// however many callers ask at once.
	opening chan struct{}
	err     error
	failed  time.Time    // when err was set
	used    atomic.Int64 // unix ns of the last use: the budget evicts the least recent
	// serving maps each connection to the tenant it last served (its
	// search_path).
	serving sync.Map // *pgx.Conn → use
}

// use is the tenant a context is for.
type use struct {
	tenant, schema string
}

type useKey struct{}

// For returns ctx naming tenant t for the pools: pass it to every call on
// the pool Pools.Pool returned for t.
func For(ctx context.Context, t pgtenants.Tenant) context.Context {
	return context.WithValue(ctx, useKey{}, use{tenant: t.ID, schema: t.Schema})
}

// noTenant marks the pools' own uses (the check at open): their
// connection's schema is set back to the database's default.
var noTenant = use{tenant: "", schema: ""}

// retryOpenAfter is how long a failed open answers every caller at once
// with its error before the next dial: the consumers of a tenant whose
// server is down would each wait for a dial of their own.
const retryOpenAfter = 2 * time.Second

// NewPools returns an empty set of pools.
func NewPools(cfg PoolsConfig) (*Pools, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Pools{cfg: cfg, m: map[string]*dbPool{}}, nil
}

// url is the database tenant t lives in, its secrets filled in.
func (p *Pools) url(t pgtenants.Tenant) (string, error) {
	if t.DatabaseURL == "" {
		return p.cfg.ControlURL, nil
	}
	u, err := pgtenants.Expand(t.DatabaseURL)
	if err != nil {
		return "", fmt.Errorf("tenant %s: %w", t.ID, err)
	}
	return u, nil
}

func where(t pgtenants.Tenant) string { return t.DatabaseURL + "\x00" + t.Schema }

// Pool returns the pool of tenant t's database, opening it if needed: use
// it with a context from For(ctx, t). A failed open answers with its error
// for a moment (retryOpenAfter), then dials again.
func (p *Pools) Pool(ctx context.Context, t pgtenants.Tenant) (*pgxpool.Pool, error) {
	url, err := p.url(t)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	db := p.m[url]
	if db != nil {
		select {
		case <-db.opening:
			if db.err != nil && time.Since(db.failed) >= retryOpenAfter {
				delete(p.m, url)
				db = nil
			}
		default: // still dialing: wait for it below
		}
	}
	if db == nil {
		db = &dbPool{url: url, opening: make(chan struct{})}
		p.m[url] = db
		go p.open(db)
	}
	p.mu.Unlock()
	db.used.Store(time.Now().UnixNano())
	select {
	case <-db.opening:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if db.err != nil {
		return nil, fmt.Errorf("tenant %s (%s): %w", t.ID, t.Location(), db.err)
	}
	return db.pool, nil
}

// TenantOf is the tenant a connection of the pools last served ("" for
// another connection).
func (p *Pools) TenantOf(conn *pgx.Conn) string {
	p.mu.Lock()
	dbs := make([]*dbPool, 0, len(p.m))
	for _, db := range p.m {
		dbs = append(dbs, db)
	}
	p.mu.Unlock()
	for _, db := range dbs {
		if u, ok := db.serving.Load(conn); ok {
			return u.(use).tenant
		}
	}
	return ""
}

// open dials with a bound of its own rather than the caller's context: a
// caller giving up must not leave a half-open pool to the next.
func (p *Pools) open(db *dbPool) {
	defer close(db.opening)
	ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), useKey{}, noTenant), 15*time.Second)
	defer cancel()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: db.url, ApplicationName: p.cfg.ApplicationName, MaxConns: p.cfg.MaxConns,
		Configure: func(c *pgxpool.Config) {
			c.MinConns = 0
			c.MaxConnIdleTime = p.cfg.IdleAfter
			// The idle connections are closed by the pool's health
			// check: at its default (a minute) an idle database would
			// hold its connections up to IdleAfter + 1m.
			c.HealthCheckPeriod = max(p.cfg.IdleAfter/2, time.Second)
			c.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error { return p.makeRoom(ctx, db) }
			c.PrepareConn = func(ctx context.Context, conn *pgx.Conn) (bool, error) { return db.prepare(ctx, conn) }
			before := c.BeforeClose
			c.BeforeClose = func(conn *pgx.Conn) {
				db.serving.Delete(conn)
				if before != nil {
					before(conn)
				}
			}
			if p.cfg.Configure != nil {
				p.cfg.Configure(c)
			}
		}})
	if err != nil {
		db.err, db.failed = err, time.Now()
		return
	}
	db.pool = pool
}

// prepare gives a connection the schema of the tenant its use names, when
// it last served another (pgxpool's PrepareConn). A use naming none is
// refused: it would run in whichever tenant's schema the connection had.
func (db *dbPool) prepare(ctx context.Context, conn *pgx.Conn) (bool, error) {
	u, ok := ctx.Value(useKey{}).(use)
	if !ok {
		return true, errors.New("tenancy: a tenant database's connection was asked for without its tenant (tenancy.For): refused, not served in another tenant's schema")
	}
	if last, ok := db.serving.Load(conn); ok && last.(use).schema == u.schema {
		db.serving.Store(conn, u)
		return true, nil
	}
	stmt := "RESET search_path" // a tenant on the database's default schema
	if u.schema != "" {
		stmt = "SET search_path TO " + pgx.Identifier{u.schema}.Sanitize()
	}
	if _, err := conn.Exec(ctx, stmt); err != nil {
		db.serving.Delete(conn)
		return false, fmt.Errorf("setting the schema of tenant %s: %w", u.tenant, err)
	}
	db.serving.Store(conn, u)
	return true, nil
}

// Connect opens a pool on tenant t's database and schema (cfg's URL and
// Schema are t's; controlURL is the database of a tenant registered
// without one), for the commands that work on one tenant at a time
// (`ferry tenants migrate`, `status`).
func Connect(ctx context.Context, controlURL string, t pgtenants.Tenant, cfg pgdb.Config) (*pgxpool.Pool, error) {
	cfg.URL, cfg.Schema = controlURL, t.Schema
	if t.DatabaseURL != "" {
		var err error
		if cfg.URL, err = pgtenants.Expand(t.DatabaseURL); err != nil {
			return nil, fmt.Errorf("tenant %s: %w", t.ID, err)
		}
	}
	pool, err := pgdb.Open(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("tenant %s (%s): %w", t.ID, t.Location(), err)
	}
	return pool, nil
}

// budgetWait bounds how long a new connection waits for the budget to
// have room when no database's connections are idle.
const budgetWait = 5 * time.Second

// ErrBudget is the error of a connection the budget had no room for.
var ErrBudget = errors.New("the tenants' connection budget is in use (FERRY_TENANTS_CONN_BUDGET)")

// makeRoom runs before a database's pool dials (pgxpool's BeforeConnect):
// while the tenants' connections, this one counted, are over the budget,
// it closes the idle connections of the database used least recently that
// has none in use, or waits for one to be idle.
//
// Written here because pgxpool bounds one pool, not a set of them, and
// the tenants' databases each need a pool of their own.
func (p *Pools) makeRoom(ctx context.Context, self *dbPool) error {
	deadline := time.Now().Add(budgetWait)
	for {
		total, victim := p.census(self)
		if total <= p.cfg.Budget {
			return nil
		}
		if victim != nil {
			victim.Reset() // its idle connections close now
			time.Sleep(time.Millisecond)
			continue
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %d connections", ErrBudget, p.cfg.Budget)
		}
		if err := pipeline.Sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

// census counts the tenants' connections (those being opened included) and
// picks the pool to evict: the least recently used with idle connections
// and none in use, other than self.
func (p *Pools) census(self *dbPool) (total int, victim *pgxpool.Pool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var oldest int64
	for _, db := range p.m {
		select {
		case <-db.opening:
		default:
			continue // its first connection counts once it is there
		}
		if db.pool == nil {
			continue
		}
		st := db.pool.Stat()
		total += int(st.TotalConns())
		if db == self || st.AcquiredConns() > 0 || st.IdleConns() == 0 {
			continue
		}
		if used := db.used.Load(); victim == nil || used < oldest {
			victim, oldest = db.pool, used
		}
	}
	return total + 1, victim // +1: the connection about to be made
}

// Open counts the databases' open pools and the connections they hold.
func (p *Pools) Open() (pools, conns int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, db := range p.m {
		select {
		case <-db.opening:
			if db.pool != nil {
				pools++
				conns += int(db.pool.Stat().TotalConns())
			}
		default:
		}
	}
	return pools, conns
}

// NewConns counts the connections the pools opened since they started.
func (p *Pools) NewConns() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var n int64
	for _, db := range p.m {
		select {
		case <-db.opening:
			if db.pool != nil {
				n += db.pool.Stat().NewConnsCount()
			}
		default:
		}
	}
	return n
}

// Close closes every pool.
func (p *Pools) Close() {
	p.mu.Lock()
	m := p.m
	p.m = map[string]*dbPool{}
	p.mu.Unlock()
	for _, db := range m {
		<-db.opening
		if db.pool != nil {
			db.pool.Close()
		}
	}
}
