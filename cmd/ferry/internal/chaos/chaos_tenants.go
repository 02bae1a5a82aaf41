package chaos

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/wait"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/examples/orders/ordersapp"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/tenancy"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The tenants run (--tenants): one fleet of two `ferry run` processes
// (FERRY_TENANTS=true) serving tenant databases on two PostgreSQL servers
// of the run's own, A and B, with the control database on A. Each tenant's
// orders are placed in its own database exactly as the README publishes
// (create_order and an ordered audit event in one transaction, some rolled
// back), while the members are SIGKILLed and rolled, the fleet's sessions
// on the tenant servers terminated, its broker connections cut and its
// handlers fail and panic; a tenant is added, one paused and resumed, one
// drained and removed, and server B is killed and brought back while the
// load runs. Then, per tenant: every committed order charged, mailed and
// audited once, in order per aggregate, each ledger row in its own
// tenant's database and none in another's or the control database's
// (nothing crossed), and A's tenants' charges made while B was down as
// soon (p99, within TenantOutageSlack) as in the quiet moment before.

// TenantOutageSlack is how much longer than in the quiet moment before B
// died the charges of server A's tenants may wait while B is down (p99,
// commit → charge). It does not grow with the outage: an event of a B
// tenant in an ordered partition they share is parked, not held
// (tenancy.Parking). Before parking, A's charges waited about as long as
// the outage itself (p99 11.1 s for a 10.6 s outage).
const TenantOutageSlack = 2 * time.Second

// quietAfterOutage is how long the fleet's faults stay paused after B is
// back: its tenants' parked events are sent back and handled, and the
// outage's orders charged, before a fault strikes again.
const quietAfterOutage = 5 * time.Second

// outageTimes are server B's outage in a tenants run: Quiet, when the
// fleet's faults paused before it (what A's tenants wait from then until
// Down is the baseline), Down and Up.
type outageTimes struct{ Quiet, Down, Up time.Time }

// TenantsRun sizes a tenants run. Zero fields take the defaults.
type TenantsRun struct {
	// Tenants is how many tenants the run has (at least 4: one added, one
	// paused, one removed, the others only loaded). Default 4.
	Tenants int
	// Rate is the orders a second over every tenant. Default 40.
	Rate int
	// Duration is how long orders are placed. Default 60 s.
	Duration time.Duration
	// Seed makes the run replayable (orders, faults). Default 1.
	Seed uint64
	// FaultEvery is the pause between two faults of the fleet. Default 2 s.
	FaultEvery time.Duration
	// HandlerFail and HandlerPanic are the handlers' fault rates. Default
	// 0.05 and 0.005.
	HandlerFail, HandlerPanic float64
	// ServerDown is how long server B stays down. Default 10 s.
	ServerDown time.Duration
	// Binary is the ferry binary to run. Default: this process's executable.
	Binary string
	// DrainTimeout bounds the wait for the pipeline to settle. Default 3m.
	DrainTimeout time.Duration
}

func (r TenantsRun) withDefaults() TenantsRun {
	r.Tenants = cmp.Or(r.Tenants, 4)
	r.Rate = cmp.Or(r.Rate, 40)
	r.Duration = cmp.Or(r.Duration, time.Minute)
	r.Seed = cmp.Or(r.Seed, 1)
	r.FaultEvery = cmp.Or(r.FaultEvery, 2*time.Second)
	r.HandlerFail = cmp.Or(r.HandlerFail, 0.05)
	r.HandlerPanic = cmp.Or(r.HandlerPanic, 0.005)
	r.ServerDown = cmp.Or(r.ServerDown, 10*time.Second)
	r.DrainTimeout = cmp.Or(r.DrainTimeout, 3*time.Minute)
	return r
}

func (r TenantsRun) validate() error {
	var errs []error
	if r.Tenants < 4 || r.Tenants > 50 {
		errs = append(errs, fmt.Errorf("tenants: %d, want 4 to 50 (one added, one paused, one removed, the others loaded)", r.Tenants))
	}
	if r.Rate < r.Tenants || r.Rate > 1000 {
		errs = append(errs, fmt.Errorf("rate: %d orders/s, want at least one a tenant (%d) and at most 1000", r.Rate, r.Tenants))
	}
	if r.Duration < 20*time.Second {
		errs = append(errs, fmt.Errorf("duration: %s, want at least 20s (the server outage, the pause and the removal take their time)", r.Duration))
	}
	if r.ServerDown <= 0 || r.ServerDown > r.Duration/2 {
		errs = append(errs, fmt.Errorf("server down: %s, want more than 0 and at most half the duration", r.ServerDown))
	}
	if r.HandlerFail < 0 || r.HandlerPanic < 0 || r.HandlerFail+r.HandlerPanic > 0.5 {
		errs = append(errs, errors.New("handler fault rates must be at least 0 and add up to at most 0.5"))
	}
	return errors.Join(errs...)
}

// TenantsReport is what a tenants run did and found.
type TenantsReport struct {
	Seed    uint64         `json:"seed"`
	Tenants []TenantReport `json:"tenants"`
	Faults  map[string]int `json:"faults"`
	// FaultsMissed are faults tried that met nothing (no live process, no
	// backend): not counted in Faults.
	FaultsMissed map[string]int `json:"faults_missed"`
	// The sums over the tenants.
	OrdersCommitted int `json:"orders_committed"`
	Lost            int `json:"lost"`
	Duplicated      int `json:"duplicated"`
	Crossed         int `json:"crossed"`
	OrderViolations int `json:"order_violations"`
	Poisoned        int `json:"poisoned"`
	PendingDue      int `json:"undispatched_due_rows"`
	// ControlLedgerRows are ledger rows of tenants' messages in the
	// control database's ledger: crossed too.
	ControlLedgerRows int `json:"control_ledger_rows"`
	// PoisonedAfterRemoval are the removed tenant's messages poisoned for
	// its removal: copies in flight when it went, its effects all in.
	PoisonedAfterRemoval int `json:"poisoned_after_removal"`
	// ChargeRequests counts the provider's requests, replays included;
	// MaxChargeRequestsPerOrder the most for one charge.
	ChargeRequests            int `json:"charge_requests"`
	MaxChargeRequestsPerOrder int `json:"max_charge_requests_per_order"`
	// HandlerFailuresSeen and HandlerPanicsSeen count the members' log
	// lines of the injected handler faults: a run whose faults never
	// fired proves nothing about them.
	HandlerFailuresSeen int `json:"handler_failures_seen"`
	HandlerPanicsSeen   int `json:"handler_panics_seen"`
	// ServerDownSeconds is how long server B was down; OutageOrders the
	// orders of server A's tenants committed meanwhile, and OutageP99 and
	// OutageMax their commit → charge delays; Before* the same for the
	// orders committed in the quiet moment before B died.
	ServerDownSeconds float64  `json:"server_down_seconds"`
	BeforeOrders      int      `json:"before_outage_orders"`
	BeforeP50         float64  `json:"before_outage_p50_seconds"`
	BeforeP99         float64  `json:"before_outage_p99_seconds"`
	OutageOrders      int      `json:"outage_orders"`
	OutageHeld        int      `json:"outage_orders_held_over_1s"`
	OutageP50         float64  `json:"outage_p50_seconds"`
	OutageP99         float64  `json:"outage_p99_seconds"`
	OutageMax         float64  `json:"outage_max_seconds"`
	Violations        []string `json:"violations"`
	ProducingSeconds  float64  `json:"producing_seconds"`
	DrainSeconds      float64  `json:"drain_seconds"`
}

// OK reports whether every invariant held.
func (r TenantsReport) OK() bool { return len(r.Violations) == 0 }

// TenantReport is one tenant's part of the run.
type TenantReport struct {
	ID     string `json:"id"`
	Server string `json:"server"`
	// What the run did to it: added while the load ran, paused and
	// resumed, drained and removed.
	Role       string `json:"role,omitempty"`
	Committed  int    `json:"orders_committed"`
	RolledBack int    `json:"orders_rolled_back"`
	Charges    int    `json:"charges"`
	Mails      int    `json:"mails"`
	Audit      int    `json:"audit_events"`
	// BatchEffects are the orders the batch route (ChaosBatchRoute)
	// counted once in the tenant's database.
	BatchEffects    int `json:"batch_route_effects"`
	Poisoned        int `json:"poisoned"`
	Lost            int `json:"lost"`
	Duplicated      int `json:"duplicated"`
	Crossed         int `json:"crossed"`
	OrderViolations int `json:"order_violations"`
	PendingDue      int `json:"undispatched_due_rows"`
	// LedgerRows are the ledger rows of its own messages in its database:
	// where the crossed check looked.
	LedgerRows int `json:"ledger_rows"`
}

// The tenants with a part to play, by index.
const (
	tenantPaused  = 1
	tenantRemoved = 2
)

// chaosTenant is one tenant of the run: its database (through a driver
// app that only places orders) and what was committed there.
type chaosTenant struct {
	id     string
	server int // 0: A, 1: B
	url    string
	schema string
	drv    *app.App
	svc    *orders.Service
	// role: "added", "paused", "removed" or "".
	role string

	mu          sync.Mutex
	committed   map[int64]time.Time // order id → commit time
	rolledBack  int
	audits      int // audit events committed
	registered  chan struct{}
	stopPlacing time.Time // the removed tenant's orders stop then
}

// ChaosTenants is the tenants run (see above); out gets the report.
func ChaosTenants(ctx context.Context, cfg app.Config, run TenantsRun, out io.Writer, logger *slog.Logger) (rep TenantsReport, err error) {
	run = run.withDefaults()
	cfg = cfg.WithDefaults()
	if err := run.validate(); err != nil {
		return rep, err
	}
	rep = TenantsReport{Seed: run.Seed, Faults: map[string]int{}, FaultsMissed: map[string]int{}, Violations: []string{}}
	id, err := begin(&run.Binary, &logger)
	if err != nil {
		return rep, err
	}
	vhost, appName := "ferry_chaos_"+id, "ferry-chaos-"+id
	var cl cleanups
	defer cl.run()

	// Two servers of the run's own: the control database and half the
	// tenants on A, the other half on B, which is killed.
	var servers [2]*pipelinetest.PostgresServer
	for i := range servers {
		s, err := pipelinetest.StartPostgres(ctx)
		if err != nil {
			return rep, fmt.Errorf("starting the run's PostgreSQL server %c: %w", 'A'+i, err)
		}
		cl.add(func() { _ = s.Stop() })
		servers[i] = s
		if err := s.Exec(ctx, "postgres", "CREATE DATABASE tenants"); err != nil {
			return rep, err
		}
	}
	if err := servers[0].Exec(ctx, "postgres", "CREATE DATABASE control"); err != nil {
		return rep, err
	}
	amqpURL, err := ownVhost(ctx, cfg.AMQP.URL, vhost, &cl)
	if err != nil {
		return rep, err
	}
	provider, sink, err := startWorld(&cl)
	if err != nil {
		return rep, err
	}
	ex := ordersapp.Config{PaymentURL: provider.URL(), SMTPAddr: sink.Addr()}.WithDefaults()
	opts := WithFaults(ordersapp.Options(ex), HandlerFaults{}, ex.PaymentURL)
	opts.Migrate, opts.Logger, opts.WithoutBroker = true, logger, true
	open := func(url, schema string) (*app.App, error) {
		c := cfg
		c.DatabaseURL, c.DatabaseSchema, c.DatabaseAppName = url, schema, appName+"-driver"
		c.AMQP.URL, c.AMQP.Namespace, c.AdminAddr = amqpURL, "", "off"
		a, err := app.New(ctx, c, opts)
		if err != nil {
			return nil, err
		}
		cl.add(func() { _ = a.Close() })
		return a, nil
	}
	controlURL := servers[0].URL("control")
	control, err := open(controlURL, "control")
	if err != nil {
		return rep, fmt.Errorf("the control database: %w", err)
	}
	tenants := make([]*chaosTenant, run.Tenants)
	for i := range tenants {
		t := &chaosTenant{id: fmt.Sprintf("t%d", i), server: i % 2, schema: fmt.Sprintf("tenant_%d", i), committed: map[int64]time.Time{}, registered: make(chan struct{})}
		t.url = servers[t.server].URL("tenants")
		if t.drv, err = open(t.url, t.schema); err != nil {
			return rep, fmt.Errorf("tenant %s's database: %w", t.id, err)
		}
		if t.svc, err = ordersapp.NewService(t.drv); err != nil {
			return rep, err
		}
		if _, err := t.drv.Pool().Exec(ctx, chaosBatchTableSQL); err != nil {
			return rep, err
		}
		tenants[i] = t
	}
	added := tenants[len(tenants)-1]
	added.role, tenants[tenantPaused].role, tenants[tenantRemoved].role = "added", "paused", "removed"
	for _, t := range tenants {
		if t == added {
			continue
		}
		if err := t.register(ctx, control); err != nil {
			return rep, err
		}
	}

	logDir, err := os.MkdirTemp("", "ferry-chaos-tenants-")
	if err != nil {
		return rep, err
	}
	env := &chaosEnv{bin: run.Binary, logDir: logDir, logger: logger, appName: appName, env: append([]string{
		"FERRY_DATABASE_URL=" + controlURL, "FERRY_DATABASE_SCHEMA=control", "FERRY_DATABASE_APP_NAME=" + appName,
		"FERRY_TENANTS=true", "FERRY_TENANTS_RELOAD=1s", "FERRY_TENANTS_SWEEP=2s",
		"FERRY_AMQP_URL=" + amqpURL, "FERRY_AMQP_NAMESPACE=",
		"FERRY_PAYMENT_URL=" + provider.URL(), "FERRY_SMTP_ADDR=" + sink.Addr(), "FERRY_HTTP_ADDR=127.0.0.1:0",
	}, childSettings...)}
	var spawned sync.Mutex
	n := uint64(0)
	faults := func() string {
		spawned.Lock()
		defer spawned.Unlock()
		n++
		return fmt.Sprintf("FERRY_CHAOS_FAULTS=fail=%g,panic=%g,seed=%d", run.HandlerFail, run.HandlerPanic, run.Seed*1000+n)
	}
	cl.add(env.stopAll)
	const members = 2
	for range members {
		if _, err := env.start("run", faults()); err != nil {
			return rep, err
		}
	}
	if err := wait.For(ctx, func() bool {
		ms, _ := tenancy.Members(ctx, control.Pool())
		return len(ms) >= members
	}); err != nil {
		return rep, fmt.Errorf("the fleet did not come up: %w; its last words: %s (logs in %s)", err, logTail(logDir), logDir)
	}

	// The load, the tenants' changes and the faults, together.
	start := time.Now()
	until := start.Add(run.Duration)
	tenants[tenantRemoved].stopPlacing = start.Add(run.Duration / 2)
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var load sync.WaitGroup
	perTenant := time.Second * time.Duration(run.Tenants) / time.Duration(run.Rate)
	loadErrs := make(chan error, len(tenants))
	for i, t := range tenants {
		load.Go(func() {
			if err := t.place(loadCtx, rand.New(rand.NewPCG(run.Seed, uint64(i+1))), perTenant, until, run.ServerDown+time.Minute); err != nil {
				loadErrs <- fmt.Errorf("tenant %s: %w", t.id, err)
			}
		})
	}
	faultCtx, stopFaults := context.WithCancel(ctx)
	var faultsDone sync.WaitGroup
	var frep sync.Mutex
	count := func(kind string, hit bool) {
		frep.Lock()
		defer frep.Unlock()
		if hit {
			rep.Faults[kind]++
		} else {
			rep.FaultsMissed[kind]++
		}
	}
	var scenarioErr error
	var down outageTimes
	// The fleet's faults pause while server B is down and a little after,
	// so that what A's tenants wait then is B's outage's doing alone.
	var quiet sync.Mutex
	faultsDone.Go(func() {
		scenarioErr = tenantScenario(faultCtx, run, start, control, tenants, servers[1], provider, sink, count, &down, &quiet)
	})
	faultsDone.Go(func() {
		fleetFaults(faultCtx, run, env, control, servers, appName, vhost, faults, count, &quiet)
	})
	load.Wait()
	rep.ProducingSeconds = time.Since(start).Seconds()
	stopFaults()
	faultsDone.Wait()
	close(loadErrs)
	for err := range loadErrs {
		return rep, err
	}
	if scenarioErr != nil {
		return rep, scenarioErr
	}
	rep.ServerDownSeconds = down.Up.Sub(down.Down).Seconds()

	// Settle: both members up, every tenant's effects in.
	for len(env.live("run")) < members {
		if _, err := env.start("run", faults()); err != nil {
			return rep, err
		}
	}
	settled := time.Now()
	chk := &tenantsCheck{control: control, tenants: tenants, provider: provider, sink: sink}
	_ = pollWithin(ctx, run.DrainTimeout, func() bool {
		done, err := chk.run(ctx, &TenantsReport{})
		return err == nil && done
	})
	rep.DrainSeconds = time.Since(settled).Seconds()
	if _, err := chk.run(ctx, &rep); err != nil {
		return rep, err
	}
	checkOutage(&rep, tenants, down, provider)
	rep.HandlerFailuresSeen, rep.HandlerPanicsSeen = handlerFaultsSeen(filepath.Join(logDir, "run.log"), run.HandlerFail, run.HandlerPanic, &rep.Violations)
	rep.Violations = capViolations(rep.Violations)
	printTenantsReport(out, rep, logDir)
	if rep.OK() {
		_ = os.RemoveAll(logDir)
	}
	return rep, nil
}

// register adds t to the registry and lets its orders start.
func (t *chaosTenant) register(ctx context.Context, control *app.App) error {
	if err := pgtenants.Add(ctx, control.Pool(), pgtenants.Tenant{ID: t.id, DatabaseURL: t.url, Schema: t.schema}, "ferry chaos"); err != nil {
		return fmt.Errorf("registering tenant %s: %w", t.id, err)
	}
	close(t.registered)
	return nil
}

// place places t's orders, one every interval from its registration until
// until (or t.stopPlacing), as a service does: an order whose transaction
// failed (its server down, a backend terminated) is tried again with the
// same idempotency key, for up to patience, since a failed commit may have
// committed.
func (t *chaosTenant) place(ctx context.Context, rng *rand.Rand, interval time.Duration, until time.Time, patience time.Duration) error {
	select {
	case <-ctx.Done():
		return nil
	case <-t.registered:
	}
	if !t.stopPlacing.IsZero() {
		until = t.stopPlacing
	}
	seq := map[string]int64{}
	next := time.Now()
	for i := 0; time.Now().Before(until); i++ {
		time.Sleep(time.Until(next))
		next = next.Add(interval)
		in := orders.Input{UserID: fmt.Sprintf("%s-user-%02d", t.id, rng.IntN(10)), Amount: int64(100 + rng.IntN(9900)),
			Currency: []string{"JPY", "USD"}[rng.IntN(2)], IdempotencyKey: fmt.Sprintf("%s-%d", t.id, i)}
		rollback := rng.Float64() < 0.05
		deadline := time.Now().Add(patience)
		for {
			orderID, err := chaosOrder(ctx, t.drv, t.svc, in, seq, rollback)
			if err == nil {
				t.mu.Lock()
				if rollback {
					t.rolledBack++
				} else {
					t.committed[orderID] = time.Now()
				}
				t.mu.Unlock()
				break
			}
			if ctx.Err() != nil {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("order %s failed for %s: %w", in.IdempotencyKey, patience, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
		if now := time.Now(); next.Before(now) {
			next = now // behind (its server was down): no burst to catch up
		}
	}
	return nil
}

// tenantScenario changes the fleet's tenants while the load runs: the
// last one is added at a quarter of the run, tenantPaused is paused for 8
// s at a third, tenantRemoved stops taking orders at half and is removed
// once its effects are in, and server B is killed at 60% for
// run.ServerDown. down gets the outage's start and end.
func tenantScenario(ctx context.Context, run TenantsRun, start time.Time, control *app.App, tenants []*chaosTenant, serverB *pipelinetest.PostgresServer,
	provider *sandbox.PaymentProvider, sink *sandbox.SMTPSink, count func(string, bool), down *outageTimes, quiet *sync.Mutex) error {
	at := func(frac float64) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(time.Until(start.Add(time.Duration(frac * float64(run.Duration))))):
			return true
		}
	}
	if !at(0.25) {
		return nil
	}
	if err := tenants[len(tenants)-1].register(ctx, control); err != nil {
		return err
	}
	count("tenant_added", true)
	if !at(0.33) {
		return nil
	}
	paused := tenants[tenantPaused]
	if err := pgtenants.Pause(ctx, control.Pool(), paused.id, "ferry chaos", "the chaos run pauses it"); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-time.After(8 * time.Second):
	}
	if err := pgtenants.Resume(context.WithoutCancel(ctx), control.Pool(), paused.id, "ferry chaos"); err != nil {
		return err
	}
	count("tenant_paused", true)
	var removal sync.WaitGroup
	removal.Go(func() {
		// Once its last order is placed and every effect of it is in
		// (or poisoned): a removal while its messages are in flight would
		// poison them, by design (an unknown tenant), and this run keeps
		// every order.
		removed := tenants[tenantRemoved]
		if !at(0.5) {
			return
		}
		chk := &tenantsCheck{control: control, tenants: []*chaosTenant{removed}, provider: provider, sink: sink}
		if err := pollWithin(ctx, 2*time.Minute, func() bool {
			done, err := chk.effectsIn(ctx, removed)
			return err == nil && done
		}); err != nil {
			return
		}
		if err := pgtenants.Remove(context.WithoutCancel(ctx), control.Pool(), removed.id, "ferry chaos"); err == nil {
			count("tenant_removed", true)
		}
	})
	defer removal.Wait()
	// Quiet from half the run (once the fault in hand, a roll perhaps, is
	// over), B killed at 60 %.
	if !at(0.5) {
		return nil
	}
	quiet.Lock()
	defer quiet.Unlock()
	down.Quiet = time.Now()
	if !at(0.6) {
		return nil
	}
	down.Down = time.Now()
	if err := serverB.Halt(); err != nil {
		return fmt.Errorf("killing server B: %w", err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(run.ServerDown):
	}
	if err := serverB.Restart(context.WithoutCancel(ctx)); err != nil {
		return fmt.Errorf("bringing server B back: %w", err)
	}
	down.Up = time.Now()
	count("tenant_server_killed", true)
	select {
	case <-ctx.Done():
	case <-time.After(quietAfterOutage):
	}
	return nil
}

// fleetFaults strikes the fleet every run.FaultEvery until ctx ends: a
// member SIGKILLed (and replaced), the members rolled with SIGTERM (one
// in six), the fleet's sessions on a tenant server terminated, its broker
// connections cut.
func fleetFaults(ctx context.Context, run TenantsRun, env *chaosEnv, control *app.App, servers [2]*pipelinetest.PostgresServer, appName, vhost string, childFaults func() string, count func(string, bool), quiet *sync.Mutex) {
	rng := rand.New(rand.NewPCG(run.Seed, 0xfa17))
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-time.After(run.FaultEvery):
		}
		quiet.Lock()
		fleetFault(ctx, i, rng, env, control, servers, appName, vhost, childFaults, count)
		quiet.Unlock()
	}
}

// fleetFault is the fleet's i-th fault.
func fleetFault(ctx context.Context, i int, rng *rand.Rand, env *chaosEnv, control *app.App, servers [2]*pipelinetest.PostgresServer, appName, vhost string, childFaults func() string, count func(string, bool)) {
	switch kind := []string{"kill_member", "terminate_tenant_backends", "close_amqp_connections", "kill_member", "terminate_tenant_backends", "roll_members"}[i%6]; kind {
	case "kill_member":
		hit, err := env.killAndRestart(rng, "run", childFaults())
		count(kind, hit && err == nil)
	case "roll_members":
		// The fleet's own database is the control's: the roll waits
		// for each replacement's heartbeat there.
		n, err := env.roll(ctx, control.Pool(), "run", syscall.SIGTERM, consumerStopWait, childFaults)
		count(kind, n > 0 && err == nil)
	case "terminate_tenant_backends":
		s := servers[rng.IntN(2)]
		n := 0
		conn, err := pgx.Connect(ctx, s.URL("tenants"))
		if err == nil {
			err = conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name LIKE $1 || '-tenants%'`, appName).Scan(&n)
			conn.Close(ctx)
		}
		count(kind, err == nil && n > 0)
	case "close_amqp_connections":
		count(kind, rabbitmqctl(ctx, "close_all_connections", "--vhost", vhost, "ferry chaos") == nil)
	}
}

// checkOutage measures the charges of server A's tenants' orders
// committed while server B was down, and in the quiet moment before it
// died: they are made, and while B is down none later (p99) than
// TenantOutageSlack past the moment before.
func checkOutage(rep *TenantsReport, tenants []*chaosTenant, down outageTimes, p *sandbox.PaymentProvider) {
	if down.Down.IsZero() || down.Up.IsZero() {
		rep.Violations = append(rep.Violations, "server B was never killed: the run measured no outage")
		return
	}
	chargedAt := map[string]time.Time{} // tenant/order → first charge
	for _, c := range p.Charges() {
		if tid, _, ok := strings.Cut(c.Customer, "-user-"); ok {
			chargedAt[tid+"/"+c.OrderID] = c.At
		}
	}
	// delays are the commit → charge delays of A's tenants' orders
	// committed in [from, to).
	delays := func(from, to time.Time) []float64 {
		var out []float64
		for _, t := range tenants {
			if t.server != 0 {
				continue
			}
			t.mu.Lock()
			for id, at := range t.committed {
				if at.Before(from) || !at.Before(to) {
					continue
				}
				if c, ok := chargedAt[fmt.Sprintf("%s/%d", t.id, id)]; ok {
					out = append(out, c.Sub(at).Seconds())
				}
			}
			t.mu.Unlock()
		}
		slices.Sort(out)
		return out
	}
	// The quiet moment's first second still drains the last fault's.
	before := delays(down.Quiet.Add(time.Second), down.Down)
	rep.BeforeOrders = len(before)
	if len(before) > 0 {
		rep.BeforeP50, rep.BeforeP99 = quantile(before, 0.50), quantile(before, 0.99)
	}
	during := delays(down.Down, down.Up)
	rep.OutageOrders = len(during)
	if len(during) == 0 {
		rep.Violations = append(rep.Violations, "no order of server A's tenants was committed and charged while server B was down: they did not go on")
		return
	}
	rep.OutageP50, rep.OutageP99, rep.OutageMax = quantile(during, 0.50), quantile(during, 0.99), during[len(during)-1]
	for _, d := range during {
		if d > 1 {
			rep.OutageHeld++
		}
	}
	if bound := rep.BeforeP99 + TenantOutageSlack.Seconds(); rep.OutageP99 > bound {
		rep.Violations = append(rep.Violations, fmt.Sprintf("while server B was down, server A's tenants' charges waited p99 %.1fs (max %.1fs) after their commit, past %.1fs (p99 %.1fs before B died, and %s)",
			rep.OutageP99, rep.OutageMax, bound, rep.BeforeP99, TenantOutageSlack))
	}
}

func printTenantsReport(w io.Writer, r TenantsReport, logDir string) {
	fmt.Fprintf(w, "Ferry chaos run, tenants (seed %d): %.1fs placing orders, %.1fs draining\n", r.Seed, r.ProducingSeconds, r.DrainSeconds)
	kinds := make([]string, 0, len(r.Faults))
	for k := range r.Faults {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	var fs []string
	total := 0
	for _, k := range kinds {
		fs = append(fs, fmt.Sprintf("%s %d", k, r.Faults[k]))
		total += r.Faults[k]
	}
	fmt.Fprintf(w, "  faults injected      %6d   (%s)\n", total, strings.Join(fs, ", "))
	fmt.Fprintf(w, "  server B down        %6.1fs  (server A's tenants: %d orders committed meanwhile, charged p50 %.2fs, p99 %.2fs, max %.2fs after their commit, %d of them after more than 1s; in the quiet moment before: %d orders, p50 %.2fs, p99 %.2fs; bound p99: that + %s)\n",
		r.ServerDownSeconds, r.OutageOrders, r.OutageP50, r.OutageP99, r.OutageMax, r.OutageHeld, r.BeforeOrders, r.BeforeP50, r.BeforeP99, TenantOutageSlack)
	fmt.Fprintf(w, "  %-6s %-6s %-8s %9s %7s %8s %6s %6s %6s %8s %5s %6s %8s %6s %6s\n", "TENANT", "SERVER", "ROLE", "COMMITTED", "ROLLED", "CHARGES", "MAILS", "AUDIT", "BATCH", "POISONED", "LOST", "DOUBLE", "CROSSED", "LEDGER", "ORDER")
	for _, t := range r.Tenants {
		fmt.Fprintf(w, "  %-6s %-6s %-8s %9d %7d %8d %6d %6d %6d %8d %5d %6d %8d %6d %6d\n", t.ID, t.Server, cmp.Or(t.Role, "-"), t.Committed, t.RolledBack,
			t.Charges, t.Mails, t.Audit, t.BatchEffects, t.Poisoned, t.Lost, t.Duplicated, t.Crossed, t.LedgerRows, t.OrderViolations)
	}
	fmt.Fprintln(w, "  (BATCH: orders the batch route counted once in the tenant's database; DOUBLE: effects made twice; CROSSED: its ledger rows of another tenant's messages; LEDGER: its ledger rows of its own; ORDER: audit events out of order)")
	fmt.Fprintf(w, "  orders committed     %6d   (%d provider requests for the charges: at most %d for one)\n", r.OrdersCommitted, r.ChargeRequests, r.MaxChargeRequestsPerOrder)
	fmt.Fprintf(w, "  handler faults seen  %6d   (%d injected failures, %d injected panics in the members' log)\n", r.HandlerFailuresSeen+r.HandlerPanicsSeen, r.HandlerFailuresSeen, r.HandlerPanicsSeen)
	fmt.Fprintf(w, "  lost %d, duplicated %d, crossed %d (%d ledger rows of tenants' messages in the control database), order violations %d, poisoned %d (and %d copies of the removed tenant's messages, for its removal), due rows left %d\n",
		r.Lost, r.Duplicated, r.Crossed, r.ControlLedgerRows, r.OrderViolations, r.Poisoned, r.PoisonedAfterRemoval, r.PendingDue)
	if r.OK() {
		fmt.Fprintln(w, "ok: per tenant, nothing lost, nothing twice, nothing crossed, order kept")
		return
	}
	fmt.Fprintf(w, "FAILED (process logs kept in %s):\n", logDir)
	for _, v := range r.Violations {
		fmt.Fprintf(w, "  - %s\n", v)
	}
}
