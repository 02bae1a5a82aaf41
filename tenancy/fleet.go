package tenancy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
)

// Defaults of Config.
const (
	DefaultWorkers = 4
	DefaultReload  = 5 * time.Second
	DefaultSweep   = 30 * time.Second
	// DefaultBacklogRoom is Config.BacklogRoom's default: about what two
	// cores' consumers handle in 50 ms.
	DefaultBacklogRoom = 100
	// DefaultBacklogSlowdown is Config.BacklogSlowdown's default: measured
	// to keep the other tenants' p99 within 2× (docs/tenants.md).
	DefaultBacklogSlowdown = 1.5
	// Component is what a fleet process names among its components in
	// ferry_instances: the fleet's members are the live processes that
	// name it, and the tenants are shared among them.
	Component = "tenants"
)

// Config configures a Fleet.
type Config struct {
	// Relay is every tenant's relay configuration; the fleet sets what it
	// decides itself (no LISTEN or probes of a relay's own: the fleet's
	// listeners, wake-ups and sweeps replace them; tenant_id stamped).
	Relay pgoutbox.RelayConfig
	// Pools bounds the connections to tenants' databases.
	Pools PoolsConfig
	// Workers is how many tenants' batches run at once. One tenant's batch
	// runs on one worker at a time, and a tenant with more to relay goes
	// back to the end of the line after each batch: a tenant's backlog
	// holds another's new event behind one batch at most, never behind
	// the backlog. Default 4.
	Workers int
	// Reload is how often the registry and the fleet's members are read
	// again. Default 5s.
	Reload time.Duration
	// Sweep bounds how long a tenant whose commits nobody announced (a
	// producer without Ferry's wake-up, the listener down) waits: each
	// served tenant is claimed at least this often. Default 30s.
	Sweep time.Duration
	// Member is this process's id in ferry_instances. With it, the tenants
	// are shared among the live members (rendezvous hashing: a member
	// joining or leaving moves only its share); without it, this process
	// serves every tenant.
	Member string
	// ControlSchema is the control database's own schema (its outbox is
	// the application's relay's): a tenant registered there is refused,
	// not served twice. "" is the database's default.
	ControlSchema string
	// Room, if set, says whether the consumers have room for more of a
	// backlog: the broker's queues that backlogs go to (the backlog lanes,
	// the ordered topics' partitions) hold fewer ready messages than
	// BacklogRoom (the app asks the broker). A tenant whose last batch came
	// back full (a backlog) waits for room before its next batch, which it
	// sends on the backlog lanes; a tenant with a few new events goes at
	// once. Without it, a backlog relayed faster than the consumers handle
	// it would pile up at the broker, and where it shares a queue with
	// other tenants' new events (an ordered topic's partition), they would
	// wait behind all of it.
	Room func(ctx context.Context) (bool, error)
	// BacklogRoom is the ready messages the route queues may hold before
	// backlogs wait (Room). Default 100; negative: backlogs never wait.
	BacklogRoom int
	// BacklogSlowdown is how much slower than without a backlog the new
	// events' batches may get before the backlogs' batches are spaced out
	// more (see pace): lower keeps the other tenants' latency, higher
	// drains a backlog sooner. Default 1.5; negative: backlogs go as fast
	// as the room lets them.
	BacklogSlowdown float64
	// Observer, if set, is told the outcome of every batch, with its
	// tenant. It is called on a worker's goroutine: keep it quick.
	Observer func(tenant string, outcomes []pgoutbox.Outcome)
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Workers == 0 {
		c.Workers = DefaultWorkers
	}
	if c.Reload == 0 {
		c.Reload = DefaultReload
	}
	if c.Sweep == 0 {
		c.Sweep = DefaultSweep
	}
	if c.BacklogRoom == 0 {
		c.BacklogRoom = DefaultBacklogRoom
	}
	if c.BacklogSlowdown == 0 {
		c.BacklogSlowdown = DefaultBacklogSlowdown
	}
	c.Pools = c.Pools.WithDefaults()
	return c
}

// Validate reports every problem of c at once.
func (c Config) Validate() error {
	var errs []error
	if c.Workers < 1 || c.Workers > 256 {
		errs = append(errs, fmt.Errorf("Config.Workers must be in [1, 256], got %d", c.Workers))
	}
	if c.Reload < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("Config.Reload must be at least 100ms, got %s", c.Reload))
	}
	if c.Sweep < time.Second {
		errs = append(errs, fmt.Errorf("Config.Sweep must be at least 1s, got %s", c.Sweep))
	}
	if c.BacklogSlowdown > 0 && c.BacklogSlowdown < 1 {
		errs = append(errs, fmt.Errorf("Config.BacklogSlowdown must be at least 1 (or negative: off), got %g", c.BacklogSlowdown))
	}
	if err := c.Pools.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Fleet relays the outboxes of every tenant in the registry that this
// process is given (Config.Member), from one process: a pool per tenant
// that holds no connection while the tenant is idle, one LISTEN connection
// per database, and a few workers taking the tenants with work in turn.
//
// Safety does not rest on the sharing: each tenant's relay takes its
// outbox's position as any relay does, so two processes serving one tenant
// for a moment (a member joining, a reload apart) never send a row twice.
// The sharing keeps them from contending for it.
type Fleet struct {
	control *pgxpool.Pool
	pub     message.Publisher
	cfg     Config
	logger  *slog.Logger
	pools   *Pools
	listen  *listeners

	mu      sync.Mutex
	known   map[string]pgtenants.Tenant // the registry, as last read
	version pgtenants.Version
	loaded  bool // known holds a read of the registry
	members []string
	cells   map[string]*cell // the tenants this process serves
	refused map[string]bool  // tenants on the control's own outbox, logged once
	ready   []*cell
	signal  chan struct{}
	// waiting are the backlogged tenants waiting for room (Config.Room),
	// first come first served; roomSignal wakes the room watch.
	waiting    []*cell
	roomSignal chan struct{}
	// pace spaces the backlogs' batches out while new events slow down.
	pace pace
}

// cell is one served tenant: its relay and its place in the schedule.
type cell struct {
	t       pgtenants.Tenant
	relay   *pgoutbox.Relay
	limiter *rate.Limiter
	timer   *time.Timer
	// queued: in the ready line; running: on a worker; again: woken while
	// running; stopped: no longer served.
	queued, running, again, stopped bool
	// waiting: backlogged, in the line for room (Config.Room).
	waiting bool
	// backlog: its last batch came back full; the next goes on the
	// backlog lanes. Only its worker reads and writes it.
	backlog   bool
	notBefore time.Time // the tenant's rate
	failures  int
	// retried: the last batch lost its session while the database
	// answered, and was tried again at once (once: then it backs off).
	retried bool
	stats   TenantStats
}

// TenantStats is what the fleet did for one tenant.
type TenantStats struct {
	Dispatched int64
	Failed     int64
	Batches    int64
	LastBatch  time.Time
	LastError  string
}

// New returns a fleet reading the registry in control and publishing to
// pub (shared by every tenant's relay: one broker connection).
func New(control *pgxpool.Pool, pub message.Publisher, cfg Config, logger *slog.Logger) (*Fleet, error) {
	if control == nil || pub == nil {
		return nil, errors.New("tenancy: New needs the control pool and a publisher")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid fleet config: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	f := &Fleet{control: control, pub: pub, cfg: cfg, logger: logger.With("component", "tenant-fleet"),
		known: map[string]pgtenants.Tenant{}, cells: map[string]*cell{}, refused: map[string]bool{}, signal: make(chan struct{}, cfg.Workers), roomSignal: make(chan struct{}, 1)}
	if cfg.Pools.ControlURL == "" {
		cfg.Pools.ControlURL = control.Config().ConnString()
	}
	userConfigure := cfg.Pools.Configure
	cfg.Pools.Configure = func(c *pgxpool.Config) {
		// A handler's follow-up events, committed on a tenant database's
		// pool, wake the relay of the tenant the connection served, in
		// this process, at once.
		w := pgoutbox.NewCommitWatch()
		w.Watch(c)
		w.OnCommitConn(func(conn *pgx.Conn) {
			if id := f.pools.TenantOf(conn); id != "" {
				f.Wake(id)
			}
		})
		if userConfigure != nil {
			userConfigure(c)
		}
	}
	pools, err := NewPools(cfg.Pools)
	if err != nil {
		return nil, err
	}
	f.pools, f.cfg = pools, cfg
	f.pace.slowdown = cfg.BacklogSlowdown
	f.listen = newListeners(f.Wake, f.logger)
	return f, nil
}

// SetMember sets Config.Member (the process's instance id, known once
// its heartbeat registered) before Run.
func (f *Fleet) SetMember(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cfg.Member = id
}

// Follow reads the registry every Config.Reload until ctx ends, serving
// no outbox: a process that only consumes knows the tenants without a
// read per event.
func (f *Fleet) Follow(ctx context.Context) error {
	tick := time.NewTicker(f.cfg.Reload)
	defer tick.Stop()
	for {
		if err := f.Load(ctx); err != nil && ctx.Err() == nil {
			f.logger.Warn("reading the tenant registry failed; using the tenants as last read", "error", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// Pools are the tenants' pools, shared with the consumers (Ledgers).
func (f *Fleet) Pools() *Pools { return f.pools }

// Load reads the registry now. Run does it every Config.Reload.
func (f *Fleet) Load(ctx context.Context) error {
	v, err := pgtenants.ReadVersion(ctx, f.control)
	if err != nil {
		return err
	}
	f.mu.Lock()
	same := v == f.version && f.loaded
	f.mu.Unlock()
	if same {
		return nil
	}
	ts, err := pgtenants.List(ctx, f.control)
	if err != nil {
		return err
	}
	known := make(map[string]pgtenants.Tenant, len(ts))
	for _, t := range ts {
		known[t.ID] = t
	}
	f.mu.Lock()
	old := f.known
	f.known, f.version, f.loaded = known, v, true
	f.mu.Unlock()
	for id := range old {
		if _, ok := known[id]; !ok {
			f.logger.Info("tenant removed", "tenant", id)
		}
	}
	for id, t := range known {
		if _, ok := old[id]; !ok && len(old) > 0 {
			f.logger.Info("tenant added", "tenant", id, "location", t.Location())
		}
	}
	return nil
}

// Tenant returns tenant id as registered. A tenant this process has not
// read yet (added a moment ago) is read from the registry at once: an
// event must not be refused for a reload this process has not made.
func (f *Fleet) Tenant(ctx context.Context, id string) (pgtenants.Tenant, error) {
	f.mu.Lock()
	t, ok := f.known[id]
	f.mu.Unlock()
	if ok {
		return t, nil
	}
	t, err := pgtenants.Get(ctx, f.control, id)
	if err != nil {
		return pgtenants.Tenant{}, err
	}
	return t, nil
}

// Run serves the tenants until ctx ends.
func (f *Fleet) Run(ctx context.Context) error {
	f.logger.Info("tenant fleet started", "workers", f.cfg.Workers, "reload", f.cfg.Reload, "sweep", f.cfg.Sweep, "member", f.cfg.Member)
	defer f.logger.Info("tenant fleet stopped")
	var wg sync.WaitGroup
	for range f.cfg.Workers {
		wg.Go(func() { f.work(ctx) })
	}
	if f.cfg.Room != nil && f.cfg.BacklogRoom > 0 {
		wg.Go(func() { f.watchRoom(ctx) })
	}
	wg.Go(func() { f.holdMembership(ctx) })
	tick := time.NewTicker(f.cfg.Reload)
	defer tick.Stop()
	failures := 0
	for {
		if err := f.reconcile(ctx); err != nil && ctx.Err() == nil {
			failures++
			if failures == 1 || failures%12 == 0 {
				f.logger.Warn("reading the tenant registry failed; serving the tenants as last read", "error", err, "failures", failures)
			}
		} else {
			failures = 0
		}
		select {
		case <-ctx.Done():
			f.listen.stop()
			f.mu.Lock()
			for _, c := range f.cells {
				f.stopCell(c)
			}
			f.mu.Unlock()
			wg.Wait()
			f.pools.Close()
			return nil
		case <-tick.C:
		}
	}
}

// reconcile reads the registry and the members, and serves what this
// process is given: new tenants start, paused, removed and handed-over
// ones stop, changed ones start again with their new settings.
func (f *Fleet) reconcile(ctx context.Context) error {
	if err := f.Load(ctx); err != nil {
		return err
	}
	members, err := f.readMembers(ctx)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.members = members
	served := map[string]pgtenants.Tenant{}
	for id, t := range f.known {
		if t.DatabaseURL == "" && t.Schema == f.cfg.ControlSchema {
			if !f.refused[id] {
				f.refused[id] = true
				f.logger.Error("tenant refused: its outbox is the control database's own, which the application's relay serves", "tenant", id, "location", t.Location())
			}
			continue
		}
		if !t.Paused && f.owns(id) {
			served[id] = t
		}
	}
	for id, c := range f.cells {
		if t, ok := served[id]; !ok || !sameSettings(t, c.t) {
			f.stopCell(c)
			delete(f.cells, id)
		}
	}
	byURL := map[string]map[string][]string{}
	for id, t := range served {
		if _, ok := f.cells[id]; !ok {
			c := &cell{t: t}
			if t.RelayRate > 0 {
				c.limiter = rate.NewLimiter(rate.Limit(t.RelayRate), batchSizeFor(f.cfg.Relay, t))
			}
			f.cells[id] = c
			f.enqueue(c)
		}
		url, err := f.pools.url(t)
		if err != nil {
			continue // the cell reports it at its first batch
		}
		if byURL[url] == nil {
			byURL[url] = map[string][]string{}
		}
		byURL[url][t.Schema] = append(byURL[url][t.Schema], id)
	}
	f.mu.Unlock()
	f.listen.set(ctx, byURL)
	return nil
}

func sameSettings(a, b pgtenants.Tenant) bool {
	return where(a) == where(b) && a.RelayRate == b.RelayRate && a.Paused == b.Paused
}

// failureBackoff spaces out the batches of a tenant whose database or
// relay fails, so that it costs the others nothing but its own tries.
var failureBackoff = pipeline.Backoff{Initial: time.Second, Max: 30 * time.Second, Multiplier: 2, Jitter: 0.2}

// runBatch relays one batch of c's outbox and says when to look again: 0
// for at once; backlog: the batch came back full, more is due.
func (f *Fleet) runBatch(ctx context.Context, c *cell) (next time.Duration, backlog bool) {
	fail := func(err error) (time.Duration, bool) {
		f.mu.Lock()
		if c.stopped {
			f.mu.Unlock()
			return 0, false // removed, moved or handed over while it ran
		}
		c.failures++
		n := c.failures
		c.stats.LastError = err.Error()
		f.mu.Unlock()
		// Built again at the next batch, with its failover check: a
		// database that failed may come back promoted.
		c.relay = nil
		if n == 1 || n%10 == 0 {
			f.logger.Warn("relaying a tenant's outbox failed; its other tenants go on", "tenant", c.t.ID, "location", c.t.Location(), "error", err, "failures", n)
		}
		return failureBackoff.Delay(n), false
	}
	if c.relay == nil {
		r, err := f.newRelay(ctx, c.t)
		if err != nil {
			return fail(err)
		}
		c.relay = r
	}
	ctx = For(ctx, c.t) // the tenant's schema, on its database's pool
	if c.backlog {
		// The backlog's events go on their topics' backlog lanes (where
		// there are lanes), not ahead of other tenants' new events.
		ctx = pipeline.ContextWithBacklogLane(ctx)
	}
	start := time.Now()
	res, err := c.relay.RelayBatch(ctx)
	if ctx.Err() != nil {
		return 0, false
	}
	// What new events' batches take (the database's part and the broker's
	// confirm, on this machine's clock) sets the backlogs' pace.
	switch {
	case c.backlog:
		f.pace.backlogRan()
	case err == nil && res.Dispatched > 0:
		f.pace.fresh(time.Since(start))
	}
	f.mu.Lock()
	c.stats.Batches++
	c.stats.Dispatched += int64(res.Dispatched)
	c.stats.Failed += int64(res.Failed)
	c.stats.LastBatch = time.Now()
	if c.limiter != nil && res.Dispatched > 0 {
		c.notBefore = time.Now().Add(reserve(c.limiter, res.Dispatched))
	}
	f.mu.Unlock()
	if err != nil {
		if !c.retried && pgdb.Unavailable(err) {
			// A session lost while the database answers (terminated,
			// reset) is tried again at once, not after a second's backoff.
			if pool, perr := f.pools.Pool(ctx, c.t); perr == nil && answers(ctx, pool) {
				c.retried = true
				return 0, false
			}
		}
		c.retried = false
		return fail(err)
	}
	c.retried = false
	if c.failures > 0 {
		f.mu.Lock()
		c.failures, c.stats.LastError = 0, ""
		f.mu.Unlock()
		f.logger.Info("relaying a tenant's outbox works again", "tenant", c.t.ID)
	}
	size := batchSizeFor(f.cfg.Relay, c.t)
	c.backlog = res.Claimed >= size || res.Passed >= size
	if c.backlog {
		return 0, true
	}
	if res.Ordered > 0 && res.Dispatched > 0 {
		return 0, false // the next rows of the aggregates it sent: not a backlog
	}
	due, err := c.relay.NextDue(ctx)
	if err != nil {
		return fail(err)
	}
	return max(min(time.Until(due), f.cfg.Sweep), time.Millisecond), false
}

// reserve takes n events from the tenant's rate and says how long its
// next batch waits. A batch larger than the bucket (both lanes of one
// RelayBatch) waits what its excess takes at the rate.
func reserve(l *rate.Limiter, n int) time.Duration {
	if r := l.ReserveN(time.Now(), n); r.OK() {
		return r.Delay()
	}
	return time.Duration(float64(n) / float64(l.Limit()) * float64(time.Second))
}

// batchSizeFor is a tenant's batch: a tenant with a rate of its own takes
// batches no larger than a second of it, so that the rate holds within a
// second rather than in bursts of a page.
func batchSizeFor(relay pgoutbox.RelayConfig, t pgtenants.Tenant) int {
	size := cmp.Or(relay.BatchSize, pgoutbox.DefaultRelayBatchSize)
	if t.RelayRate > 0 {
		size = max(1, min(size, int(t.RelayRate)))
	}
	return size
}

func (f *Fleet) newRelay(ctx context.Context, t pgtenants.Tenant) (*pgoutbox.Relay, error) {
	pool, err := f.pools.Pool(ctx, t)
	if err != nil {
		return nil, err
	}
	cfg := f.cfg.Relay
	// The fleet wakes, probes and polls for the relay: none of its own
	// loops run (RelayBatch only), so these only shape its batches.
	cfg.PollOnly, cfg.ProbeInterval = true, -1
	cfg.MarkEachRow = nil
	cfg.BatchSize = batchSizeFor(cfg, t)
	if t.RelayRate > 0 || (f.cfg.Room != nil && f.cfg.BacklogRoom > 0) {
		// A backlog goes a batch at a time, each when there is room:
		// pages of a thousand would fill the queues ten times past it.
		cfg.CatchUpBatchSize = cfg.BatchSize
	}
	stamp := map[string]string{pipeline.MetaTenantID: t.ID}
	for k, v := range cfg.Stamp {
		stamp[k] = v
	}
	cfg.Stamp = stamp
	if obs := f.cfg.Observer; obs != nil {
		user := cfg.Observer
		cfg.Observer = func(o []pgoutbox.Outcome) {
			if user != nil {
				user(o)
			}
			obs(t.ID, o)
		}
	}
	r, err := pgoutbox.NewRelay(pool, f.pub, cfg, f.logger.With("tenant", t.ID))
	if err != nil {
		return nil, err
	}
	// What a failover of the tenant's database left to send goes first.
	if _, err := r.CheckFailover(For(ctx, t)); err != nil {
		return nil, err
	}
	return r, nil
}

// TenantStatus is one served tenant's state, for status and metrics.
type TenantStatus struct {
	Tenant pgtenants.Tenant
	TenantStats
	Failing bool
}

// Served lists the tenants this process serves, by id.
func (f *Fleet) Served() []TenantStatus {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]TenantStatus, 0, len(f.cells))
	for _, c := range f.cells {
		out = append(out, TenantStatus{Tenant: c.t, TenantStats: c.stats, Failing: c.failures > 0})
	}
	slices.SortFunc(out, func(a, b TenantStatus) int { return strings.Compare(a.Tenant.ID, b.Tenant.ID) })
	return out
}

// Known is the registry as this process last read it.
func (f *Fleet) Known() []pgtenants.Tenant {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]pgtenants.Tenant, 0, len(f.known))
	for _, t := range f.known {
		out = append(out, t)
	}
	slices.SortFunc(out, func(a, b pgtenants.Tenant) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Connections counts the open tenant pools, the connections they hold
// and the LISTEN connections.
func (f *Fleet) Connections() (pools, conns, listeners int) {
	pools, conns = f.pools.Open()
	return pools, conns, f.listen.count()
}
