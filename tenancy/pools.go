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
	DefaultTenantMaxConns = 4
	// DefaultTenantConnBudget leaves a server of max_connections 100 room
	// for the control database's pool (24) and another member's budget.
	DefaultTenantConnBudget = 40
	// DefaultTenantIdleAfter is shorter than the sweep (DefaultSweep), so
	// that an idle tenant's connection closes between two sweeps instead
	// of being taken again by each.
	DefaultTenantIdleAfter = 10 * time.Second
)

// PoolsConfig bounds the connections the fleet opens to tenants' databases.
type PoolsConfig struct {
	// ControlURL is the control database, where a tenant registered without
	// a database URL lives (a tenant per schema).
	ControlURL string
	// MaxConns is the most connections one process opens to one tenant.
	// Default 4.
	MaxConns int32
	// IdleAfter closes a tenant's connection once it has been idle this
	// long, so that an idle tenant holds none: 300 tenants fit a server's
	// max_connections only if the ones with nothing to do give theirs back.
	// Default 10s.
	IdleAfter time.Duration
	// Budget bounds the connections this process holds to all tenants'
	// databases together. A connection beyond it first closes the idle
	// connections of the tenant used least recently; when none is idle it
	// waits up to 5 s for one to be, then fails (a relay batch tries again
	// later; a handler's event is deferred). Default 40.
	Budget int
	// ApplicationName shows in the tenants' pg_stat_activity. Default
	// "ferry-tenants".
	ApplicationName string
	// Configure, if set, adjusts each tenant's pool configuration last
	// (the fleet watches commits with it).
	Configure func(tenant string, cfg *pgxpool.Config)
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
	if c.Budget < int(c.MaxConns) {
		errs = append(errs, fmt.Errorf("PoolsConfig.Budget (%d) must be at least MaxConns (%d)", c.Budget, c.MaxConns))
	}
	return errors.Join(errs...)
}

// Pools opens each tenant's pool at its first use and keeps it while the
// tenant stays where it was registered; a tenant moved (another URL or
// schema) gets a new pool, a tenant removed loses its own.
type Pools struct {
	cfg PoolsConfig
	mu  sync.Mutex
	m   map[string]*tenantPool
}

type tenantPool struct {
	where string // the tenant's URL and schema as stored, to notice a move
	pool  *pgxpool.Pool
	// opening is closed once pool (or err) is set: one dial per tenant
	// however many handlers ask at once.
	opening chan struct{}
	err     error
	failed  time.Time    // when err was set
	used    atomic.Int64 // unix ns of the last Pool call: the budget evicts the least recent
}

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
	return &Pools{cfg: cfg, m: map[string]*tenantPool{}}, nil
}

func where(t pgtenants.Tenant) string { return t.DatabaseURL + "\x00" + t.Schema }

// Pool returns tenant t's pool, opening it if needed. A failed open is not
// kept: the next call dials again.
func (p *Pools) Pool(ctx context.Context, t pgtenants.Tenant) (*pgxpool.Pool, error) {
	p.mu.Lock()
	tp := p.m[t.ID]
	if tp != nil {
		select {
		case <-tp.opening:
			if tp.err != nil && time.Since(tp.failed) >= retryOpenAfter {
				delete(p.m, t.ID)
				tp = nil
			}
		default: // still dialing: wait for it below
		}
	}
	if tp != nil && tp.where != where(t) {
		delete(p.m, t.ID)
		go closeWhenOpen(tp)
		tp = nil
	}
	if tp == nil {
		tp = &tenantPool{where: where(t), opening: make(chan struct{})}
		p.m[t.ID] = tp
		go p.open(tp, t)
	}
	p.mu.Unlock()
	tp.used.Store(time.Now().UnixNano())
	select {
	case <-tp.opening:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if tp.err != nil {
		return nil, tp.err
	}
	return tp.pool, nil
}

// budgetWait bounds how long a new connection waits for the budget to
// have room when no tenant's connections are idle.
const budgetWait = 5 * time.Second

// ErrBudget is the error of a connection the budget had no room for.
var ErrBudget = errors.New("the tenants' connection budget is in use (FERRY_TENANTS_CONN_BUDGET)")

// makeRoom runs before tenant id's pool dials (pgxpool's BeforeConnect):
// while the tenants' connections, this one counted, are over the budget,
// it closes the idle connections of the tenant used least recently that
// has no connection in use, or waits for one to be idle.
//
// Written here because pgxpool bounds one pool, not a set of them, and a
// fleet's tenants each need a pool of their own (its search_path, its
// server).
func (p *Pools) makeRoom(ctx context.Context, id string) error {
	deadline := time.Now().Add(budgetWait)
	for {
		total, victim := p.census(id)
		if total <= p.cfg.Budget {
			return nil
		}
		if victim != nil {
			victim.Reset() // its idle connections close now
			time.Sleep(time.Millisecond)
			continue
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("tenant %s: %w: %d connections", id, ErrBudget, p.cfg.Budget)
		}
		if err := pipeline.Sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

// census counts the tenants' connections (those being opened included) and
// picks the pool to evict: the least recently used with idle connections
// and none in use, other than id's.
func (p *Pools) census(id string) (total int, victim *pgxpool.Pool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var oldest int64
	for tid, tp := range p.m {
		select {
		case <-tp.opening:
		default:
			continue // its first connection counts once it is there
		}
		if tp.pool == nil {
			continue
		}
		st := tp.pool.Stat()
		total += int(st.TotalConns())
		if tid == id || st.AcquiredConns() > 0 || st.IdleConns() == 0 {
			continue
		}
		if used := tp.used.Load(); victim == nil || used < oldest {
			victim, oldest = tp.pool, used
		}
	}
	return total + 1, victim // +1: the connection about to be made
}

// open dials with a bound of its own rather than the caller's context: a
// caller giving up must not leave a half-open pool to the next.
func (p *Pools) open(tp *tenantPool, t pgtenants.Tenant) {
	defer close(tp.opening)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	pool, err := Connect(ctx, p.cfg.ControlURL, t, pgdb.Config{ApplicationName: p.cfg.ApplicationName, MaxConns: p.cfg.MaxConns,
		Configure: func(c *pgxpool.Config) {
			c.MinConns = 0
			c.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error { return p.makeRoom(ctx, t.ID) }
			c.MaxConnIdleTime = p.cfg.IdleAfter
			// The idle connections are closed by the pool's health
			// check: at its default (a minute) an idle tenant would hold
			// its connection up to IdleAfter + 1m.
			c.HealthCheckPeriod = max(p.cfg.IdleAfter/2, time.Second)
			if p.cfg.Configure != nil {
				p.cfg.Configure(t.ID, c)
			}
		}})
	if err != nil {
		tp.err, tp.failed = err, time.Now()
		return
	}
	tp.pool = pool
}

// Connect opens a pool on tenant t's database and schema (cfg's URL and
// Schema are t's; controlURL is the database of a tenant registered
// without one), for the fleet and for the commands that work on each
// tenant (`ferry tenants migrate`).
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

func closeWhenOpen(tp *tenantPool) {
	<-tp.opening
	if tp.pool != nil {
		tp.pool.Close()
	}
}

// Drop closes tenant id's pool, if open: the tenant was removed. The
// close waits for the connections in use (a handler's transaction) in the
// background, not in the caller's reload.
func (p *Pools) Drop(id string) {
	p.mu.Lock()
	tp := p.m[id]
	delete(p.m, id)
	p.mu.Unlock()
	if tp != nil {
		go closeWhenOpen(tp)
	}
}

// Open counts the tenants' open pools and the connections they hold.
func (p *Pools) Open() (pools, conns int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, tp := range p.m {
		select {
		case <-tp.opening:
			if tp.pool != nil {
				pools++
				conns += int(tp.pool.Stat().TotalConns())
			}
		default:
		}
	}
	return pools, conns
}

// Close closes every pool.
func (p *Pools) Close() {
	p.mu.Lock()
	m := p.m
	p.m = map[string]*tenantPool{}
	p.mu.Unlock()
	for _, tp := range m {
		closeWhenOpen(tp)
	}
}
