package chaos

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/wait"

	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/examples/orders/ordersapp"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// providerGarbage is a provider's answer in Latin-1 with a NUL.
var providerGarbage = []byte("Zahlung abgelehnt: Kunde ung\xfcltig\x00 (Gateway \xe9chou\xe9)")

// outageBacklog is how many charges the database outage waits to have
// queued before it starts: it must meet consumers with work to do.
const outageBacklog = 100

// chaosDatabase is the database of a run on its own server.
const chaosDatabase = "chaos"

// holdingThePartition is the consumers' log line for a partition held
// behind a failing head (middleware.DurableRetryConfig).
const holdingThePartition = "holding the partition until the retry"

// consumerStopWait bounds a consumer's graceful stop in a rolling restart:
// the run's FERRY_SHUTDOWN_TIMEOUT (10s) and the process's exit.
const consumerStopWait = 20 * time.Second

// maxChargeRequests bounds the provider's requests for one charge: the
// run's 10 deliveries of a message, each with the 3 quick retries, and a
// few redeliveries. A message retried in a hot loop shows far above it.
const maxChargeRequests = 10*(1+3) + 10

// ChaosRun sizes a fault-injection run. Zero fields take the defaults.
type ChaosRun struct {
	// Orders to place. Default 2,000.
	Orders int
	// Rate of create_order calls per second. Default 200.
	Rate int
	// Relays and Consumers are how many `ferry relay` / `ferry consume`
	// processes run. Default 2 each.
	Relays, Consumers int
	// Seed makes the run replayable (orders, faults, handler faults). Default 1.
	Seed uint64
	// FaultEvery is the pause between two injected faults. Default 500ms.
	FaultEvery time.Duration
	// RollbackRate is the share of create_order transactions rolled back
	// after publishing. Default 0.05.
	RollbackRate float64
	// HandlerFail and HandlerPanic are the handlers' fault rates. Default 0.10 and 0.01.
	HandlerFail, HandlerPanic float64
	// RestartBroker adds broker restarts (rabbitmqctl stop_app/start_app)
	// to the faults: they hit every user of the broker, so only the long run has them.
	RestartBroker bool
	// RelayMode is the relay processes' mode: "notify" (default) or "cdc",
	// the CDC variant (two CDC relays on one slot, one standing by; the
	// same faults, the walsender's backend among those terminated).
	RelayMode string
	// DatabaseOutage, if set, runs the whole pipeline on a PostgreSQL
	// server of the run's own and, once while orders are placed, makes its
	// database refuse connections for this long (ALLOW_CONNECTIONS false,
	// every backend terminated), as a failover or a maintenance window
	// does: relays and consumers must wait it out, poisoning nothing.
	DatabaseOutage time.Duration
	// HA runs the pipeline on clusters of the run's own: a 3-node RabbitMQ
	// cluster (quorum queues; FERRY_AMQP_URL lists the nodes) and a
	// PostgreSQL primary with a synchronous standby (FERRY_DATABASE_URL
	// lists both, target_session_attrs=read-write); among the faults, once
	// each: the broker node the pipeline's connections are on stopped for
	// 5 s, and a database failover (the primary crashes, the standby is
	// promoted). The driver retries an order whose commit failed (its
	// idempotency key makes the retry safe).
	HA bool
	// Restarts, if set, makes rolling restarts of the consumers the run's
	// only fault, with this signal: "sigterm" (a deploy: each process
	// drains and stops) or "sigkill" (each is killed). Before each roll
	// the provider fails the next charges, so that held partitions and
	// retries are in flight when the processes stop. A sigterm run also
	// requires that no effect ran twice. Default "": every fault, a
	// rolling restart with SIGTERM among them.
	Restarts string
	// Versions makes a version roll the run's only fault: the charge event
	// goes from version 1 to 2 to 3 while orders flow. Each step rolls the
	// consumers first (one at a time, the new code up before the old stops,
	// so old and new read one queue at once), then the producers publish
	// the new version. Version 1's code poisons the charges of a multiple
	// of 97 (VersionBugText); once the pipeline drained under version 3,
	// they are requeued and must succeed. Nothing may be poisoned for its
	// version, lost or done twice.
	Versions bool
	// MinConsumerStops, if set, keeps the faults going after the last
	// order until the rolls have stopped at least this many consumer
	// processes (at most two minutes more): on a loaded machine a roll
	// takes longer, and a run that stopped few processes proves little.
	MinConsumerStops int
	// Binary is the ferry binary to run. Default: this process's executable.
	Binary string
	// DrainTimeout bounds the wait for the pipeline to settle. Default 3m.
	DrainTimeout time.Duration
}

func (r ChaosRun) withDefaults() ChaosRun {
	r.Orders = cmp.Or(r.Orders, 2000)
	r.Rate = cmp.Or(r.Rate, 200)
	r.Relays = cmp.Or(r.Relays, 2)
	r.Consumers = cmp.Or(r.Consumers, 2)
	if r.Seed == 0 {
		r.Seed = 1
	}
	if r.FaultEvery == 0 {
		r.FaultEvery = 500 * time.Millisecond
	}
	if r.RollbackRate == 0 {
		r.RollbackRate = 0.05
	}
	if r.HandlerFail == 0 {
		r.HandlerFail = 0.10
	}
	if r.HandlerPanic == 0 {
		r.HandlerPanic = 0.01
	}
	if r.DrainTimeout == 0 {
		r.DrainTimeout = 3 * time.Minute
	}
	r.RelayMode = cmp.Or(r.RelayMode, app.RelayModeNotify)
	return r
}

// ChaosReport is what a run did and found.
type ChaosReport struct {
	Seed             uint64         `json:"seed"`
	RelayMode        string         `json:"relay_mode"`
	OrdersCommitted  int            `json:"orders_committed"`
	OrdersRolledBack int            `json:"orders_rolled_back"`
	OrderReplays     int            `json:"order_replays_deduped"`
	Faults           map[string]int `json:"faults"`
	// FaultsMissed are faults tried that met nothing (no live process, no
	// backend) or were cut short by the run's end: not counted in Faults.
	FaultsMissed map[string]int `json:"faults_missed"`
	// HandlerFailuresSeen and HandlerPanicsSeen count the children's log
	// lines that show an injected handler failure or panic: the run checks
	// that the faults it promised (--faults) happened.
	HandlerFailuresSeen int            `json:"handler_failures_seen"`
	HandlerPanicsSeen   int            `json:"handler_panics_seen"`
	ChargeRequests      int            `json:"charge_requests"`
	Charges             int            `json:"charges"`
	Mails               int            `json:"mails_delivered"`
	MailDuplicates      int            `json:"mail_duplicates_dropped_by_message_id"`
	AuditEvents         int            `json:"audit_events"`
	RelayRetries        int            `json:"rows_with_relay_retries"`
	DurableRetries      int            `json:"durable_retries"`
	Poisoned            int            `json:"poisoned"`
	PoisonReasons       map[string]int `json:"poison_reasons"`
	Redeliveries        int            `json:"ledger_duplicates_suppressed"`
	Lost                int            `json:"lost"`
	Duplicated          int            `json:"duplicated"`
	// BatchEffects is how many orders the batch route (ChaosBatchRoute)
	// counted; Lost and Duplicated cover it too.
	BatchEffects    int `json:"batch_route_effects"`
	Orphans         int `json:"effects_without_committed_order"`
	OrderViolations int `json:"order_violations"`
	// ConsumerStops is how many consumer processes the rolling restarts
	// stopped (each replaced first, as a Deployment rolls).
	ConsumerStops int `json:"consumer_stops"`
	// VersionRequeued is how many messages the version roll requeued from
	// the poison store after version 3 was deployed (version 1's bug).
	VersionRequeued int `json:"version_requeued"`
	// ProducerVersion is the charge event version the driver published
	// last (the version roll moves it to 3).
	ProducerVersion int `json:"producer_version,omitempty"`
	// PartitionHolds is how many times a consumer held an ordered
	// partition behind a failing head (its WARN line in the consumers'
	// logs): the holds the stops met.
	PartitionHolds int `json:"partition_holds"`
	// EffectReplays is how many times a handler ran an effect whose
	// idempotency key (charge, audit) or Message-ID (mail) was done
	// already: the key kept it single, but the handler ran twice. A
	// clean stop must cause none; a SIGKILL may.
	EffectReplays int `json:"effect_replays"`
	PendingDue    int `json:"undispatched_due_rows"`
	// MaxChargeRequestsPerOrder is the most requests the provider got for
	// one charge: bounded by the attempts, however the run went (a hot
	// loop would show as thousands).
	MaxChargeRequestsPerOrder int     `json:"max_charge_requests_per_order"`
	DatabaseOutageSeconds     float64 `json:"database_outage_seconds"`
	// ChargesWaitingAtOutage is how many committed orders had not reached
	// the provider when the database went: the load the outage met.
	ChargesWaitingAtOutage int `json:"charges_waiting_at_outage"`
	// HA: the broker node loss (stop to back up) and the database
	// failover (crash to the standby promoted), and how many order
	// attempts the driver had to repeat.
	HA                    bool     `json:"ha"`
	BrokerNodeLostSeconds float64  `json:"broker_node_lost_seconds"`
	FailoverSeconds       float64  `json:"database_failover_seconds"`
	OrderRetries          int      `json:"order_retries"`
	Violations            []string `json:"violations"`
	ProducingSeconds      float64  `json:"producing_seconds"`
	DrainSeconds          float64  `json:"drain_seconds"`
}

// OK reports whether every invariant held.
func (r ChaosReport) OK() bool { return len(r.Violations) == 0 }

type child struct {
	role string
	cmd  *exec.Cmd
	done chan struct{}
}

type chaosEnv struct {
	bin string
	env []string
	// version, if set, is the event version children started now run
	// (FERRY_CHAOS_EVENT_VERSION): the version roll changes it.
	version  atomic.Value
	logDir   string
	mu       sync.Mutex
	children []*child
	logger   *slog.Logger
}

// startOwnPostgres starts a PostgreSQL server of the run's own with the
// run's database; the caller stops it.
func startOwnPostgres(ctx context.Context) (*pipelinetest.PostgresServer, error) {
	pg, err := pipelinetest.StartPostgres(ctx)
	if err != nil {
		return nil, fmt.Errorf("starting the run's own PostgreSQL: %w", err)
	}
	if err := pg.Exec(ctx, "postgres", "CREATE DATABASE "+chaosDatabase); err != nil {
		_ = pg.Stop()
		return nil, err
	}
	return pg, nil
}

func (e *chaosEnv) start(role string, extra ...string) (*child, error) {
	logf, err := os.OpenFile(filepath.Join(e.logDir, role+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(e.bin, role)
	cmd.Env = append(append(os.Environ(), e.env...), extra...)
	if v, _ := e.version.Load().(string); v != "" {
		cmd.Env = append(cmd.Env, "FERRY_CHAOS_EVENT_VERSION="+v)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", role, err)
	}
	c := &child{role: role, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); logf.Close(); close(c.done) }()
	e.mu.Lock()
	e.children = append(e.children, c)
	e.mu.Unlock()
	return c, nil
}

// live returns the children of role still running.
func (e *chaosEnv) live(role string) []*child {
	e.mu.Lock()
	defer e.mu.Unlock()
	var live []*child
	for _, c := range e.children {
		select {
		case <-c.done:
		default:
			if c.role == role {
				live = append(live, c)
			}
		}
	}
	return live
}

// kill SIGKILLs one live child of role and starts a replacement.
// It reports whether it killed anything: with no live child of role (all
// stopped by another fault meanwhile) it only starts one, and that is no
// kill to count.
func (e *chaosEnv) killAndRestart(rng *rand.Rand, role string, extra ...string) (bool, error) {
	live := e.live(role)
	if len(live) == 0 {
		_, err := e.start(role, extra...)
		return false, err
	}
	victim := live[rng.IntN(len(live))]
	killed := victim.cmd.Process.Signal(syscall.SIGKILL) == nil
	<-victim.done
	_, err := e.start(role, extra...)
	return killed, err
}

// roll restarts every live child of role, one at a time, as a Deployment
// rolls: a replacement is started and waited for (its heartbeat row), then
// the old process gets sig and is waited for. It returns how many it
// stopped. A process that does not stop within stopWait is killed and
// reported: a graceful stop must end within the shutdown timeout.
func (e *chaosEnv) roll(ctx context.Context, pool *pgxpool.Pool, role string, sig syscall.Signal, stopWait time.Duration, extra func() string) (int, error) {
	stopped := 0
	for _, victim := range e.live(role) {
		if ctx.Err() != nil {
			return stopped, nil
		}
		select {
		case <-victim.done:
			continue // another fault got it first: not this roll's to stop
		default:
		}
		fresh, err := e.start(role, extra())
		if err != nil {
			return stopped, err
		}
		// Up: its heartbeat row is there. A replacement can also die at
		// start (another fault cut its database sessions): then this roll
		// ends, and the next one starts over.
		exited := false
		if err := wait.For(ctx, func() bool {
			select {
			case <-fresh.done:
				exited = true
				return true
			default:
			}
			var n int
			_ = pool.QueryRow(ctx, `SELECT count(*) FROM ferry_instances WHERE pid = $1`, fresh.cmd.Process.Pid).Scan(&n)
			return n > 0
		}); err != nil {
			if ctx.Err() != nil {
				return stopped, nil
			}
			return stopped, fmt.Errorf("the replacement %s did not come up: %w", role, err)
		}
		if exited {
			return stopped, fmt.Errorf("the replacement %s exited at start (%v)", role, fresh.cmd.ProcessState)
		}
		_ = victim.cmd.Process.Signal(sig)
		select {
		case <-victim.done:
		case <-time.After(stopWait):
			_ = victim.cmd.Process.Kill()
			<-victim.done
			return stopped + 1, fmt.Errorf("a %s did not stop within %s of %s", role, stopWait, sig)
		}
		stopped++
	}
	return stopped, nil
}

func (e *chaosEnv) stopAll() {
	e.mu.Lock()
	children := append([]*child(nil), e.children...)
	e.mu.Unlock()
	for _, c := range children {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, c := range children {
		select {
		case <-c.done:
		case <-time.After(20 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}
}

func rabbitmqctl(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "rabbitmqctl", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Chaos places orders through create_order while it SIGKILLs and restarts
// relay and consumer processes (real `ferry` processes), terminates their
// database backends, cuts their broker connections, and their handlers fail
// and panic at random; then it stops the faults, waits for the pipeline to
// drain and checks that every committed order got exactly one charge and
// one mail, that rolled-back orders got none, that per-aggregate order held
// on the ordered audit topic, that every poisoned message has a reason and
// that no due row is left undispatched. It runs in a schema, a RabbitMQ
// vhost and a database application name of its own, so other users of the
// servers are untouched (except by RestartBroker).
func Chaos(ctx context.Context, cfg app.Config, run ChaosRun, out io.Writer, logger *slog.Logger) (rep ChaosReport, err error) {
	run = run.withDefaults()
	cfg = cfg.WithDefaults()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if err := run.validate(); err != nil {
		return ChaosReport{}, err
	}
	rep = ChaosReport{Seed: run.Seed, RelayMode: run.RelayMode, HA: run.HA, Faults: map[string]int{}, FaultsMissed: map[string]int{}, PoisonReasons: map[string]int{}}
	rng := rand.New(rand.NewPCG(run.Seed, run.Seed+1))
	if run.Binary == "" {
		if run.Binary, err = os.Executable(); err != nil {
			return rep, err
		}
	}
	id := fmt.Sprintf("%d", time.Now().UnixNano())
	schema, vhost, appName := "ferry_chaos_"+id, "ferry_chaos_"+id, "ferry-chaos-"+id
	var cl cleanups
	defer cl.run()
	srv, err := startServers(ctx, &cfg, run, &cl)
	if err != nil {
		return rep, fmt.Errorf("starting the run's servers: %w", err)
	}

	world, err := sandbox.StartWorld()
	if err != nil {
		return rep, err
	}
	cl.add(func() { world.Close() })
	provider, sink := world.Payments, world.SMTP
	driver, svc, c, err := startDriver(ctx, cfg, run, schema, vhost, appName, provider, sink, logger, &cl)
	if err != nil {
		return rep, fmt.Errorf("starting the driver: %w", err)
	}

	env, childFaults, err := startChildren(ctx, cfg, c, run, schema, appName, provider, sink, driver, logger, &cl)
	if err != nil {
		return rep, fmt.Errorf("starting the relay and consumer processes: %w", err)
	}
	logDir := env.logDir

	faults := startFaults(ctx, run, env, driver, provider, srv, vhost, appName, childFaults, &rep)
	seq, committedKeys, err := placeOrders(ctx, run, rng, driver, svc, faults.retried, &rep)
	if err != nil {
		faults.stop()
		return rep, fmt.Errorf("placing orders (%d committed): %w", rep.OrdersCommitted, err)
	}
	if err := faults.finish(ctx); err != nil {
		logger.Warn("some faults could not be injected", "error", err)
	}

	if err := settleAndCheck(ctx, run, env, driver, provider, sink, seq, committedKeys, childFaults, logDir, &rep); err != nil {
		return rep, fmt.Errorf("waiting for every effect and checking them (logs in %s): %w", logDir, err)
	}
	printChaosReport(out, rep, logDir)
	if rep.OK() {
		_ = os.RemoveAll(logDir)
	}
	return rep, nil
}

// startDriver is the second phase: the run's vhost (unless HA: its
// cluster is its own), and the driver, the example application in the
// run's schema that places the orders. It returns the driver's
// configuration, whose broker URL the children share; cl closes the
// driver, drops the schema and the vhost when the run ends.
func startDriver(ctx context.Context, cfg app.Config, run ChaosRun, schema, vhost, appName string, provider *sandbox.PaymentProvider, sink *sandbox.SMTPSink,
	logger *slog.Logger, cl *cleanups) (*app.App, *orders.Service, app.Config, error) {
	c := cfg
	if !run.HA {
		// A vhost of its own: cutting "all" connections cuts only this
		// run's. (The HA run's cluster is its own already.)
		if err := rabbitmqctl(ctx, "add_vhost", vhost); err != nil {
			return nil, nil, c, err
		}
		cl.add(func() { _ = rabbitmqctl(context.WithoutCancel(ctx), "delete_vhost", vhost) })
		amqpURL, err := url.Parse(cfg.AMQP.URL)
		if err != nil {
			return nil, nil, c, err
		}
		user := amqpURL.User.Username()
		if err := rabbitmqctl(ctx, "set_permissions", "-p", vhost, user, ".*", ".*", ".*"); err != nil {
			return nil, nil, c, err
		}
		amqpURL.Path = "/" + vhost
		c.AMQP.URL = amqpURL.String()
	}
	c.DatabaseSchema, c.DatabaseAppName = schema, appName+"-driver"
	c.AMQP.Namespace = ""
	c.AdminAddr = "off"
	ex := ordersapp.Config{PaymentURL: provider.URL(), SMTPAddr: sink.Addr()}.WithDefaults()
	// The driver only places orders: it holds no broker connection for the
	// faults to cut (the relays declare the topology when they start).
	opts := WithFaults(ordersapp.Options(ex), HandlerFaults{FailRate: run.HandlerFail, PanicRate: run.HandlerPanic, Seed: run.Seed}, ex.PaymentURL)
	opts.Migrate, opts.Logger, opts.WithoutBroker = true, logger, true
	driver, err := app.New(ctx, c, opts)
	if err != nil {
		return nil, nil, c, err
	}
	svc, err := ordersapp.NewService(driver)
	if err != nil {
		driver.Close()
		return nil, nil, c, err
	}
	if _, err := driver.Pool().Exec(ctx, chaosBatchTableSQL); err != nil {
		driver.Close()
		return nil, nil, c, err
	}
	cl.add(func() {
		driver.Close()
		if admin, aerr := pgdb.Open(context.WithoutCancel(ctx), pgdb.Config{URL: cfg.DatabaseURL}); aerr == nil {
			_ = pgdb.DropSchema(context.WithoutCancel(ctx), admin, schema)
			admin.Close()
		}
	})
	return driver, svc, c, nil
}

// startChildren is the third phase: the relays and consumers as separate
// processes of the binary, with the run's configuration, up and
// heartbeating. faults gives each child its own handler-fault seed; cl
// stops the children (and drops a CDC run's slot) when the run ends.
func startChildren(ctx context.Context, cfg, c app.Config, run ChaosRun, schema, appName string, provider *sandbox.PaymentProvider, sink *sandbox.SMTPSink,
	driver *app.App, logger *slog.Logger, cl *cleanups) (*chaosEnv, func() string, error) {
	logDir, err := os.MkdirTemp("", "ferry-chaos-")
	if err != nil {
		return nil, nil, err
	}
	env := &chaosEnv{bin: run.Binary, logDir: logDir, logger: logger, env: []string{
		"FERRY_DATABASE_URL=" + cfg.DatabaseURL, "FERRY_DATABASE_SCHEMA=" + schema, "FERRY_DATABASE_APP_NAME=" + appName,
		"FERRY_AMQP_URL=" + c.AMQP.URL, "FERRY_AMQP_NAMESPACE=",
		"FERRY_PAYMENT_URL=" + provider.URL(), "FERRY_SMTP_ADDR=" + sink.Addr(),
		"FERRY_ADMIN_ADDR=off", "FERRY_LOG_FORMAT=json", "FERRY_LOG_LEVEL=warn",
		"FERRY_RELAY_POLL_INTERVAL=100ms", "FERRY_RELAY_BACKOFF_INITIAL=200ms", "FERRY_RELAY_BACKOFF_MAX=2s",
		"FERRY_DURABLE_RETRY_INITIAL=200ms", "FERRY_DURABLE_RETRY_MAX=2s", "FERRY_DURABLE_RETRY_MAX_ATTEMPTS=10",
		"FERRY_RETRY_INITIAL_INTERVAL=10ms", "FERRY_RETRY_MAX_INTERVAL=50ms", "FERRY_SHUTDOWN_TIMEOUT=10s",
	}}
	if run.RelayMode == app.RelayModeCDC {
		// The slot belongs to the cluster, not the schema: removed after
		// the children stop (this cleanup runs after stopAll's).
		env.env = append(env.env, "FERRY_RELAY_MODE=cdc", "FERRY_CDC_SLOT="+schema,
			"FERRY_CDC_SAFETY_NET_INTERVAL=1s", "FERRY_CDC_SAFETY_NET_MIN_AGE=3s")
		cl.add(func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			if _, _, err := pgcdc.DropWhenInactive(dctx, driver.Pool(), schema, schema); err != nil {
				logger.Warn("dropping the chaos run's replication slot", "slot", schema, "error", err)
			}
		})
	}
	// Every child gets the chaos route table (relays need it too: it makes
	// the audit topic ordered); only consumers run handlers, so only they
	// meet the faults. Each process draws its faults from a seed of its own.
	// Children are started by the fault loop and the rolls at once.
	if run.Versions {
		env.version.Store("1")
	}
	var spawned atomic.Uint64
	faults := func() string {
		return fmt.Sprintf("FERRY_CHAOS_FAULTS=fail=%g,panic=%g,seed=%d", run.HandlerFail, run.HandlerPanic, run.Seed*1000+spawned.Add(1))
	}
	cl.add(env.stopAll)
	for range run.Relays {
		if _, err := env.start("relay", faults()); err != nil {
			return nil, nil, err
		}
	}
	for range run.Consumers {
		if _, err := env.start("consume", faults()); err != nil {
			return nil, nil, err
		}
	}
	if err := wait.For(ctx, func() bool {
		var relays, consumers int
		_ = driver.Pool().QueryRow(ctx, `SELECT count(*) FILTER (WHERE components LIKE '%relay%'), count(*) FILTER (WHERE components LIKE '%consumers%') FROM ferry_instances`).Scan(&relays, &consumers)
		return relays >= run.Relays && consumers >= run.Consumers
	}); err != nil {
		return nil, nil, fmt.Errorf("children did not come up: %w; their last words: %s (logs in %s)", err, logTail(logDir), logDir)
	}
	return env, faults, nil
}

// faultPhase is the faults injected while the driver places orders: the
// rolling restarts, the fault loop, the database outage and the HA faults,
// each in a goroutine of its own.
type faultPhase struct {
	run ChaosRun
	rep *ChaosReport
	// gate keeps the driver's own database work and the database outage
	// (or failover) apart.
	gate   sync.RWMutex
	ctx    context.Context // ends the faults
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	err    error // what could not be injected: reported, not fatal
	// outageDone and haDone close when the outage and the HA faults,
	// which happen once each, are over.
	outageDone, haDone chan struct{}
}

// startFaults is the fourth phase: every fault of the run, started in the
// background until finish or stop. childFaults gives a restarted child its
// handler-fault seed.
func startFaults(ctx context.Context, run ChaosRun, env *chaosEnv, driver *app.App, provider *sandbox.PaymentProvider, srv servers,
	vhost, appName string, childFaults func() string, rep *ChaosReport) *faultPhase {
	f := &faultPhase{run: run, rep: rep}
	f.ctx, f.cancel = context.WithCancel(ctx)
	faultCtx := f.ctx
	outage, failover, brokerNodes := srv.outage, srv.failover, srv.brokerNodes
	// recordFault records how a fault went: its error (what failed) joins
	// the run's, which are reported, not fatal; or it counts as one more
	// of kind, and done, if any, notes what it did, under the same lock.
	recordFault := func(kind, what string, err error, done func()) {
		f.mu.Lock()
		defer f.mu.Unlock()
		if err != nil {
			f.err = errors.Join(f.err, fmt.Errorf("%s: %w", what, err))
			return
		}
		rep.Faults[kind]++
		if done != nil {
			done()
		}
	}
	// rollConsumers restarts the consumers one by one with sig, first
	// failing the next charges so that partitions are held and retries in
	// flight when the processes stop.
	rollConsumers := func(kind string, sig syscall.Signal) {
		provider.FailNext(12)
		n, err := env.roll(faultCtx, driver.Pool(), "consume", sig, consumerStopWait, childFaults)
		if faultCtx.Err() != nil {
			if n == 0 {
				return // cut short before it stopped anything: not a fault injected
			}
			err = nil // cut short by the run's end: what it stopped counts
		}
		recordFault(kind, kind, err, func() { rep.ConsumerStops += n })
	}
	// The rolls run beside the other faults, one after another: a roll
	// takes seconds (each replacement must come up first) and would hold
	// the other faults back.
	kind, sig := "rolling_restart", syscall.SIGTERM
	if run.Restarts != "" {
		kind, sig = "rolling_restart_"+run.Restarts, map[string]syscall.Signal{"sigterm": syscall.SIGTERM, "sigkill": syscall.SIGKILL}[run.Restarts]
	}
	if run.Versions {
		// The version roll: the consumers to version 2 at a fifth of the
		// orders, to version 3 at three fifths (the producers follow at two
		// and four fifths: placeOrders). Each roll starts the new code
		// before it stops the old.
		producing := time.Duration(run.Orders) * time.Second / time.Duration(run.Rate)
		start := time.Now()
		// finish waits for both rolls (haDone), as for the HA faults.
		f.outageDone, f.haDone = make(chan struct{}), make(chan struct{})
		close(f.outageDone)
		f.wg.Go(func() {
			defer close(f.haDone)
			for _, step := range []struct {
				at      time.Duration
				version string
			}{{producing / 5, "2"}, {producing * 3 / 5, "3"}} {
				select {
				case <-faultCtx.Done():
					return
				case <-time.After(time.Until(start.Add(step.at))):
				}
				env.version.Store(step.version)
				n, err := env.roll(context.WithoutCancel(faultCtx), driver.Pool(), "consume", syscall.SIGTERM, consumerStopWait, childFaults)
				recordFault("version_consumers_v"+step.version, "rolling the consumers to version "+step.version, err, func() { rep.ConsumerStops += n })
			}
		})
		return f
	}
	f.wg.Go(func() {
		for {
			select {
			case <-faultCtx.Done():
				return
			case <-time.After(run.FaultEvery):
			}
			rollConsumers(kind, sig)
		}
	})
	f.wg.Go(func() {
		if run.Restarts != "" {
			return
		}
		frng := rand.New(rand.NewPCG(run.Seed^0xfa17, run.Seed))
		kinds := []string{"kill_relay", "kill_consumer", "terminate_db_backends", "close_amqp_connections", "provider_non_utf8"}
		for n := 1; ; n++ {
			select {
			case <-faultCtx.Done():
				return
			case <-time.After(run.FaultEvery):
			}
			// Each round of len(kinds) faults has every kind once, in a
			// seeded order: a short run meets each of them, a long one
			// stays unpredictable.
			if (n-1)%len(kinds) == 0 {
				frng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
			}
			kind := kinds[(n-1)%len(kinds)]
			// A broker restart takes seconds and stops everything: every
			// tenth fault at most, so the others still come thick and fast.
			if run.RestartBroker && n%10 == 0 {
				kind = "restart_broker"
			}
			var err error
			// hit is whether the fault met anything: a kill with no live
			// process, or a termination that matched no backend, injected
			// nothing and is not counted.
			hit := true
			switch kind {
			case "kill_relay":
				hit, err = env.killAndRestart(frng, "relay", childFaults())
			case "kill_consumer":
				hit, err = env.killAndRestart(frng, "consume", childFaults())
			case "terminate_db_backends":
				f.gate.RLock()
				var n int
				err = driver.Pool().QueryRow(faultCtx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, appName).Scan(&n)
				f.gate.RUnlock()
				hit = n > 0
			case "close_amqp_connections":
				if run.HA {
					// Cluster-wide, through a node the node-loss fault
					// leaves alone (a rabbitmqctl call takes a second or two).
					err = brokerNodes[1].Run("close_all_connections", "--global", "--vhost", "/", "ferry chaos")
				} else {
					err = rabbitmqctl(faultCtx, "close_all_connections", "--vhost", vhost, "ferry chaos")
				}
			case "provider_non_utf8":
				// The next charges are answered 503 in Latin-1 with a NUL.
				provider.FailNextWithGarbage(3, providerGarbage)
			case "restart_broker":
				// Both halves run to the end even when the run ends
				// meanwhile: a stop_app cut short still stops the node's
				// app, and a broker left stopped would fail the drain and
				// every later run on this machine.
				if err = rabbitmqctl(context.WithoutCancel(faultCtx), "stop_app"); err == nil {
					err = rabbitmqctl(context.WithoutCancel(faultCtx), "start_app")
				}
			}
			if faultCtx.Err() != nil {
				// Cut short by the run's end: neither an error nor a fault
				// injected.
				f.mu.Lock()
				rep.FaultsMissed[kind]++
				f.mu.Unlock()
				return
			}
			if !hit && err == nil {
				f.mu.Lock()
				rep.FaultsMissed[kind]++
				f.mu.Unlock()
				continue
			}
			recordFault(kind, kind, err, nil)
		}
	})

	// The database outage, once, a third of the way through the orders:
	// the driver (the application) stands still while its database is
	// gone; relays and consumers keep trying, and must poison nothing.
	f.outageDone = make(chan struct{})
	if outage == nil {
		close(f.outageDone)
	} else {
		f.wg.Go(func() {
			defer close(f.outageDone)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Duration(run.Orders/3) * time.Second / time.Duration(run.Rate)):
			}
			// Under load: a slow provider first, so that charges wait in
			// the broker when the database goes, and consumers meet the
			// outage mid-message. The outage starts once enough wait,
			// however fast the driver places orders on this machine.
			provider.SetDelay(300 * time.Millisecond)
			defer provider.SetDelay(0)
			provider.FailNextWithGarbage(5, providerGarbage)
			recordFault("provider_non_utf8", "", nil, nil)
			backlog := 0
			for wait := time.Now().Add(30 * time.Second); time.Now().Before(wait) && backlog < outageBacklog; {
				select {
				case <-ctx.Done():
					return
				case <-time.After(100 * time.Millisecond):
				}
				var placed int
				_ = driver.Pool().QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&placed)
				backlog = placed - provider.Requests()
			}
			f.gate.Lock()
			defer f.gate.Unlock()
			began := time.Now()
			err := outage(ctx, false)
			if err == nil {
				select {
				case <-ctx.Done():
				case <-time.After(run.DatabaseOutage):
				}
				err = outage(context.WithoutCancel(ctx), true)
			}
			recordFault("database_refuses_connections", "database outage", err, func() {
				rep.DatabaseOutageSeconds = time.Since(began).Seconds()
				rep.ChargesWaitingAtOutage = backlog
			})
		})
	}

	// The HA faults, once each while orders are placed: at a fifth, the
	// broker node the pipeline's connections are on (the first that
	// answers: the first) stops for 5 s; at half, the database fails over,
	// the driver standing still meanwhile (its retries cover the commits
	// the crash cuts).
	f.haDone = make(chan struct{})
	if !run.HA {
		close(f.haDone)
	} else {
		orderTime := time.Duration(run.Orders) * time.Second / time.Duration(run.Rate)
		at := func(frac float64) <-chan time.Time { return time.After(time.Duration(float64(orderTime) * frac)) }
		var ha sync.WaitGroup
		ha.Go(func() {
			select {
			case <-ctx.Done():
				return
			case <-at(0.2):
			}
			node := brokerNodes[0]
			began := time.Now()
			err := node.Run("stop_app")
			if err == nil {
				time.Sleep(5 * time.Second)
				err = node.Run("start_app")
			}
			recordFault("broker_node_lost", "broker node loss", err, func() {
				rep.BrokerNodeLostSeconds = time.Since(began).Seconds()
			})
		})
		ha.Go(func() {
			select {
			case <-ctx.Done():
				return
			case <-at(0.5):
			}
			f.gate.Lock()
			began := time.Now()
			err := failover(context.WithoutCancel(ctx))
			f.gate.Unlock()
			recordFault("database_failover", "database failover", err, func() {
				rep.FailoverSeconds = time.Since(began).Seconds()
			})
		})
		f.wg.Go(func() { ha.Wait(); close(f.haDone) })
	}
	return f
}

// retried runs fn beside the outage (the gate's read lock). In an HA run a
// failure is tried again, 100 ms apart, up to 100 times: after a failover
// the driver's connections to the old primary are gone, and its first
// tries fail. Each retry counts in *retries, if not nil.
func (f *faultPhase) retried(fn func() error, retries *int) error {
	f.gate.RLock()
	err := fn()
	f.gate.RUnlock()
	for try := 0; err != nil && f.run.HA && try < 100 && f.ctx.Err() == nil; try++ {
		if retries != nil {
			*retries++
		}
		time.Sleep(100 * time.Millisecond)
		f.gate.RLock()
		err = fn()
		f.gate.RUnlock()
	}
	return err
}

// finish waits for the faults that happen once (the outage happens while
// orders wait, even if the driver placed its last one first), then stops
// the others; it returns what could not be injected.
func (f *faultPhase) finish(ctx context.Context) error {
	select {
	case <-f.outageDone:
	case <-ctx.Done():
	}
	select {
	case <-f.haDone:
	case <-ctx.Done():
	}
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline) && ctx.Err() == nil; {
		f.mu.Lock()
		stops := f.rep.ConsumerStops
		f.mu.Unlock()
		if stops >= f.run.MinConsumerStops {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	f.stop()
	return f.err
}

// stop ends every fault and waits for their goroutines.
func (f *faultPhase) stop() {
	f.cancel()
	f.wg.Wait()
}

// placeOrders is the driver's part while the faults run: orders at a
// steady rate, some rolled back after publishing, some replayed by a client
// retrying after a timeout (which must be deduplicated). retried runs each
// beside the database outage. It returns the audit events expected per
// aggregate and the committed orders' keys.
func placeOrders(ctx context.Context, run ChaosRun, rng *rand.Rand, driver *app.App, svc *orders.Service,
	retried func(fn func() error, retries *int) error, rep *ChaosReport) (map[string]int64, []string, error) {
	// Orders at a steady rate, some rolled back after publishing, some replayed.
	start := time.Now()
	interval := time.Second / time.Duration(run.Rate)
	seq := map[string]int64{}
	var committedKeys []string
	if run.Versions {
		rep.ProducerVersion = 1
	}
	for i := range run.Orders {
		time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
		if run.Versions && (i == run.Orders*2/5 || i == run.Orders*4/5) {
			// The producers follow the consumers to the next version.
			fn, err := chargeEventOf(rep.ProducerVersion + 1)
			if err != nil {
				return seq, committedKeys, err
			}
			svc.SetChargeEvent(fn)
			rep.ProducerVersion++
		}
		userID := fmt.Sprintf("user-%02d", rng.IntN(40))
		in := orders.Input{UserID: userID, Amount: int64(100 + rng.IntN(9900)), Currency: []string{"JPY", "USD"}[rng.IntN(2)], IdempotencyKey: fmt.Sprintf("chaos-%d", i)}
		rollback := rng.Float64() < run.RollbackRate
		err := retried(func() error { return chaosOrder(ctx, driver, svc, in, seq, rollback) }, &rep.OrderRetries)
		if err != nil {
			return seq, committedKeys, fmt.Errorf("placing order %d: %w", i, err)
		}
		if rollback {
			rep.OrdersRolledBack++
			continue
		}
		rep.OrdersCommitted++
		committedKeys = append(committedKeys, in.IdempotencyKey)
		if rng.IntN(20) == 0 { // a client retrying after a timeout
			var res orders.Result
			err := retried(func() (err error) {
				res, err = svc.CreateOrder(ctx, in)
				return err
			}, nil)
			if err != nil || !res.Deduped {
				rep.Violations = append(rep.Violations, fmt.Sprintf("replay of %s was not deduplicated (err %v)", in.IdempotencyKey, err))
			}
			rep.OrderReplays++
		}
	}
	rep.ProducingSeconds = time.Since(start).Seconds()
	return seq, committedKeys, nil
}

// settleAndCheck is the last phase: every role back to full strength, the
// pipeline drained (every effect of every committed order there, or its
// message poisoned), then every invariant checked into rep.
func settleAndCheck(ctx context.Context, run ChaosRun, env *chaosEnv, driver *app.App, provider *sandbox.PaymentProvider, sink *sandbox.SMTPSink,
	seq map[string]int64, committedKeys []string, faults func() string, logDir string, rep *ChaosReport) error {
	// Every role back to full strength, then wait for the pipeline to settle.
	for _, role := range []struct {
		name  string
		count int
	}{{"relay", run.Relays}, {"consume", run.Consumers}} {
		for live := len(env.live(role.name)); live < role.count; live++ {
			if _, err := env.start(role.name, faults()); err != nil {
				return err
			}
		}
	}
	drainStart := time.Now()
	expectAudit := 0
	for _, n := range seq {
		expectAudit += int(n)
	}
	dctx, cancel := context.WithTimeout(ctx, run.DrainTimeout)
	defer cancel()
	// Settled when every effect of every committed order is there or its
	// message is poisoned: the batch route's counts too, which a message
	// waiting out the database outage (its wait grows to 30 s) may still
	// owe after the mails are out.
	settled := func() bool {
		var pending, poisoned, counted int
		_ = driver.Pool().QueryRow(dctx, `SELECT (SELECT count(*) FROM `+pgoutbox.Table{}.View(pgoutbox.StatePending)+`), (SELECT count(*) FROM poison_messages),
			(SELECT count(*) FROM `+ChaosBatchTable+`)`).Scan(&pending, &poisoned, &counted)
		charges, mails := chargesByOrder(provider), mailsByOrder(sink)
		return pending == 0 && len(charges)+poisoned >= rep.OrdersCommitted && len(mails)+poisoned >= rep.OrdersCommitted &&
			len(provider.Audit())+poisoned >= expectAudit && counted+poisoned >= rep.OrdersCommitted
	}
	drainErr := wait.For(dctx, settled)
	if run.Versions && drainErr == nil {
		// Version 3 is deployed everywhere: what version 1's code poisoned
		// (its bug) goes back, as version 1 events, and must succeed.
		var bugged int
		_ = driver.Pool().QueryRow(dctx, `SELECT count(*) FROM poison_messages WHERE reason LIKE '%' || $1 || '%'`, VersionBugText).Scan(&bugged)
		if bugged == 0 {
			rep.Violations = append(rep.Violations, "version 1's bug poisoned nothing: the run proves nothing about requeueing old versions")
		}
		res, err := driver.Poison().Requeue(dctx, pgpoison.Selector{All: true}, pgpoison.Run{Actor: "ferry chaos"})
		if err != nil {
			return fmt.Errorf("requeueing after the version roll: %w", err)
		}
		rep.VersionRequeued = len(res.Requeued)
		drainErr = wait.For(dctx, settled)
	}
	time.Sleep(500 * time.Millisecond) // room for a late duplicate to show
	rep.DrainSeconds = time.Since(drainStart).Seconds()
	if drainErr != nil {
		rep.Violations = append(rep.Violations, fmt.Sprintf("the pipeline did not drain within %s (logs in %s)", run.DrainTimeout, logDir))
	}
	if err := checkChaos(ctx, driver, provider, sink, committedKeys, expectAudit, rep); err != nil {
		return err
	}
	if b, err := os.ReadFile(filepath.Join(logDir, "consume.log")); err == nil {
		rep.PartitionHolds = strings.Count(string(b), holdingThePartition)
		// The handler faults the run promised must have happened: a run
		// whose faults never fired proves nothing about them.
		rep.HandlerFailuresSeen = strings.Count(string(b), injectedFailureText)
		rep.HandlerPanicsSeen = strings.Count(string(b), injectedPanic)
	}
	if run.HandlerFail > 0 && rep.HandlerFailuresSeen == 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("handler failures were asked for (rate %.3f) but none shows in the consumers' log", run.HandlerFail))
	}
	if run.HandlerPanic > 0 && rep.HandlerPanicsSeen == 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("handler panics were asked for (rate %.3f) but none shows in the consumers' log", run.HandlerPanic))
	}
	chargeReplays, auditReplays := provider.Replays()
	rep.EffectReplays = chargeReplays + auditReplays + rep.MailDuplicates
	if run.Restarts == "sigterm" && rep.EffectReplays > 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("clean stops ran effects twice: %d charges, %d audit events, %d mails came again",
			chargeReplays, auditReplays, rep.MailDuplicates))
	}
	return nil
}

// validate refuses runs whose faults contradict each other.
func (r ChaosRun) validate() error {
	if r.RelayMode != app.RelayModeNotify && r.RelayMode != app.RelayModeCDC {
		return fmt.Errorf("relay mode %q: want %s or %s", r.RelayMode, app.RelayModeNotify, app.RelayModeCDC)
	}
	if r.Restarts != "" && r.Restarts != "sigterm" && r.Restarts != "sigkill" {
		return fmt.Errorf("restarts %q: want sigterm or sigkill", r.Restarts)
	}
	if r.Versions && (r.Restarts != "" || r.HA || r.DatabaseOutage > 0 || r.RestartBroker) {
		return errors.New("a version roll has no other faults: not with rolling restarts, HA, a database outage or broker restarts")
	}
	if r.Restarts != "" && (r.HA || r.DatabaseOutage > 0 || r.RestartBroker) {
		return errors.New("a run of rolling restarts has no other faults: not with HA, a database outage or broker restarts")
	}
	if r.HA && (r.DatabaseOutage > 0 || r.RestartBroker || r.RelayMode == app.RelayModeCDC) {
		return errors.New("the HA run has its own database and broker faults: not with a database outage, broker restarts or the CDC relay")
	}
	return nil
}

// servers are the run's own database and broker, when its faults need
// them: a database to refuse connections (outage) or to fail over, and a
// RabbitMQ cluster to lose a node of.
type servers struct {
	// outage makes the run's own database refuse connections (allow
	// false) or take them again; nil without DatabaseOutage.
	outage func(ctx context.Context, allow bool) error
	// failover halts the HA run's primary and promotes its standby.
	failover    func(ctx context.Context) error
	brokerNodes []*pipelinetest.RabbitNode
}

// startServers is the first phase: the servers of the run's own, cfg
// pointed at them; cl stops them when the run ends.
func startServers(ctx context.Context, cfg *app.Config, run ChaosRun, cl *cleanups) (servers, error) {
	var srv servers

	if run.DatabaseOutage > 0 {
		// Refusing connections is a property of a whole database: the run
		// takes a server of its own, so the shared one is never touched.
		pg, err := startOwnPostgres(ctx)
		if err != nil {
			return srv, err
		}
		cl.add(func() { _ = pg.Stop() })
		cfg.DatabaseURL = pg.URL(chaosDatabase)
		srv.outage = func(ctx context.Context, allow bool) error {
			if err := pg.Exec(ctx, "postgres", fmt.Sprintf("ALTER DATABASE %s ALLOW_CONNECTIONS %t", chaosDatabase, allow)); err != nil || allow {
				return err
			}
			return pg.Exec(ctx, "postgres", `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, chaosDatabase)
		}
	}

	// The HA run's clusters, and its two faults.
	if run.HA {
		pg, err := startOwnPostgres(ctx)
		if err != nil {
			return srv, err
		}
		cl.add(func() { _ = pg.Stop() })
		standby, err := pg.StartStandby(ctx, true)
		if err != nil {
			return srv, fmt.Errorf("starting the run's standby: %w", err)
		}
		cl.add(func() { _ = standby.Stop() })
		cfg.DatabaseURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
			pg.Port, standby.Port, chaosDatabase)
		srv.failover = func(ctx context.Context) error {
			if err := pg.Halt(); err != nil {
				return err
			}
			return standby.Promote(ctx)
		}
		if srv.brokerNodes, err = pipelinetest.StartRabbitCluster(ctx, 3); err != nil {
			return srv, fmt.Errorf("starting the run's RabbitMQ cluster: %w", err)
		}
		cl.add(func() {
			for _, n := range srv.brokerNodes {
				_ = n.Close()
			}
		})
		urls := make([]string, len(srv.brokerNodes))
		for i, n := range srv.brokerNodes {
			urls[i] = n.Config.URL
		}
		cfg.AMQP.URL = strings.Join(urls, ",")
	}
	return srv, nil
}

// cleanups are what a run undoes when it ends, in reverse order (as
// defers would, across the phases).
type cleanups []func()

func (c *cleanups) add(f func()) { *c = append(*c, f) }

func (c *cleanups) run() {
	for i := len(*c) - 1; i >= 0; i-- {
		(*c)[i]()
	}
}

// chaosOrder places one order with its audit event in one transaction, or
// rolls the transaction back after publishing.
func chaosOrder(ctx context.Context, a *app.App, svc *orders.Service, in orders.Input, seq map[string]int64, rollback bool) error {
	tx, err := a.DB().BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	res, err := svc.CreateOrderTx(ctx, tx, in)
	if err != nil {
		return err
	}
	if res.Deduped {
		// A retry of an order whose commit went through though its answer
		// was lost (a crash mid-commit): its audit event committed with it.
		seq[in.UserID]++
		return nil
	}
	evt, err := pipeline.NewEvent(ctx, in.UserID, ChaosAudit{Aggregate: in.UserID, Seq: seq[in.UserID]})
	if err != nil {
		return err
	}
	if err := a.Outbox().PublishEventsTx(ctx, tx, pipeline.Outgoing{Topic: ChaosAuditTopic, Msg: evt}); err != nil {
		return err
	}
	if rollback {
		return tx.Rollback()
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	a.Outbox().Committed()
	seq[in.UserID]++
	return nil
}

func chargesByOrder(p *sandbox.PaymentProvider) map[string]int {
	out := map[string]int{}
	for _, c := range p.Charges() {
		out[c.OrderID]++
	}
	return out
}

// mailsByOrder counts distinct mails (by Message-ID, which a receiver
// deduplicates on) per order, from their subject "Your order #N".
func mailsByOrder(s *sandbox.SMTPSink) map[string]int {
	seen := map[string]bool{}
	out := map[string]int{}
	for _, m := range s.Mails() {
		if seen[m.MessageID] {
			continue
		}
		seen[m.MessageID] = true
		out[strings.TrimPrefix(m.Subject, "Your order #")]++
	}
	return out
}

// injectedFault reports whether a poison reason is one of the handler
// faults the run injects (chaos_faults.go), and nothing else.
func injectedFault(reason string) bool {
	return strings.Contains(reason, injectedFailureText) || strings.Contains(reason, injectedPanic)
}

func checkChaos(ctx context.Context, a *app.App, p *sandbox.PaymentProvider, s *sandbox.SMTPSink, committedKeys []string, expectAudit int, rep *ChaosReport) error {
	var ids []string
	rows, err := a.Pool().Query(ctx, `SELECT id::text FROM orders ORDER BY id`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return err
		}
		ids = append(ids, id)
	}
	rows.Close()
	if len(ids) != len(committedKeys) {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d orders committed by the driver but %d in the table", len(committedKeys), len(ids)))
	}
	poisoned, err := a.Poison().List(ctx, "", 0)
	if err != nil {
		return err
	}
	poisonedOrder := map[string]bool{}
	poisonedBatch := map[string]bool{} // by order, the batch route's own
	for _, pm := range poisoned {
		if pipeline.RouteName(pm.Consumer) == ChaosBatchRoute {
			poisonedBatch[pm.AggregateID] = true
		}
		rep.Poisoned++
		if strings.TrimSpace(pm.Reason) == "" {
			rep.Violations = append(rep.Violations, fmt.Sprintf("poisoned message %d has no reason", pm.ID))
		} else if !injectedFault(pm.Reason) {
			// Only a handler that failed on purpose may poison a message:
			// a database or broker fault is infrastructure, waited out.
			rep.Violations = append(rep.Violations, fmt.Sprintf("poisoned message %d (%s) for a reason no fault injected: %.200s", pm.ID, pm.Topic, pm.Reason))
		}
		reason := pm.Reason
		if i := strings.Index(reason, ":"); i > 0 && i < 60 {
			reason = reason[:i]
		}
		rep.PoisonReasons[reason]++
		poisonedOrder[pm.AggregateID] = true
	}
	charges, mails := chargesByOrder(p), mailsByOrder(s)
	rep.ChargeRequests, rep.Charges, rep.AuditEvents = p.Requests(), len(p.Charges()), len(p.Audit())
	rep.MaxChargeRequestsPerOrder = p.MaxRequestsPerKey()
	if rep.MaxChargeRequestsPerOrder > maxChargeRequests {
		rep.Violations = append(rep.Violations, fmt.Sprintf("a charge was requested %d times: more than its attempts allow (%d), a hot loop",
			rep.MaxChargeRequestsPerOrder, maxChargeRequests))
	}
	mailCount := len(s.Mails())
	for _, n := range mails {
		rep.Mails += n
	}
	rep.MailDuplicates = mailCount - rep.Mails
	committed := map[string]bool{}
	for _, id := range ids {
		committed[id] = true
		for what, n := range map[string]int{"charge": charges[id], "mail": mails[id]} {
			switch {
			case n > 1:
				rep.Duplicated++
				rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: %d %ss", id, n, what))
			case n == 0 && !poisonedOrder[id]:
				rep.Lost++
				rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: no %s and nothing in the poison store", id, what))
			}
		}
	}
	seen := map[string]int{}
	rows, err = a.Pool().Query(ctx, `SELECT order_id, n FROM `+ChaosBatchTable)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			rows.Close()
			return err
		}
		seen[id] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, id := range ids {
		switch n := seen[id]; {
		case n > 1:
			rep.Duplicated++
			rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: counted %d times by the batch route", id, n))
		case n == 0 && !poisonedBatch[id]:
			rep.Lost++
			rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: not counted by the batch route and nothing of it in the poison store", id))
		case n == 1:
			rep.BatchEffects++
		}
	}
	for id := range seen {
		if !committed[id] {
			rep.Orphans++
			rep.Violations = append(rep.Violations, fmt.Sprintf("the batch route counted order %s, which was never committed", id))
		}
	}
	for id := range charges {
		if !committed[id] {
			rep.Orphans++
			rep.Violations = append(rep.Violations, fmt.Sprintf("a charge for order %s, which was never committed", id))
		}
	}
	for id := range mails {
		if !committed[id] {
			rep.Orphans++
			rep.Violations = append(rep.Violations, fmt.Sprintf("a mail for order %s, which was never committed", id))
		}
	}
	last := map[string]int64{}
	for _, e := range p.Audit() {
		if prev, ok := last[e.Aggregate]; ok && e.Seq <= prev {
			rep.OrderViolations++
			rep.Violations = append(rep.Violations, fmt.Sprintf("aggregate %s: audit seq %d after %d", e.Aggregate, e.Seq, prev))
		}
		last[e.Aggregate] = e.Seq
	}
	if rep.AuditEvents+rep.Poisoned < expectAudit {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d audit events committed but %d arrived", expectAudit, rep.AuditEvents))
	}
	if err := a.Pool().QueryRow(ctx, `SELECT (SELECT count(*) FROM `+pgoutbox.Table{}.View(pgoutbox.StatePending)+` o WHERE available_at <= now()),
		count(*) FILTER (WHERE attempts > 1), count(*) FILTER (WHERE topic = $1) FROM outbox`, pipeline.RetryTopic).
		Scan(&rep.PendingDue, &rep.RelayRetries, &rep.DurableRetries); err != nil {
		return err
	}
	if rep.PendingDue > 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d due rows left undispatched", rep.PendingDue))
	}
	if len(rep.Violations) > 20 {
		rep.Violations = append(rep.Violations[:20], fmt.Sprintf("… and %d more", len(rep.Violations)-20))
	}
	return nil
}

func printChaosReport(w io.Writer, r ChaosReport, logDir string) {
	var b strings.Builder
	fmt.Fprintf(&b, "Ferry chaos run (seed %d, relay mode %s): %.1fs placing orders, %.1fs draining\n", r.Seed, r.RelayMode, r.ProducingSeconds, r.DrainSeconds)
	fmt.Fprintf(&b, "  orders committed       %6d   (+%d rolled back after publishing, %d replays deduped)\n", r.OrdersCommitted, r.OrdersRolledBack, r.OrderReplays)
	var faults []string
	total := 0
	for _, k := range []string{"kill_relay", "kill_consumer", "rolling_restart", "rolling_restart_sigterm", "rolling_restart_sigkill", "terminate_db_backends", "close_amqp_connections", "provider_non_utf8", "restart_broker", "database_refuses_connections",
		"broker_node_lost", "database_failover", "version_consumers_v2", "version_consumers_v3"} {
		if n, ok := r.Faults[k]; ok {
			faults = append(faults, fmt.Sprintf("%s %d", k, n))
			total += n
		}
	}
	fmt.Fprintf(&b, "  faults injected        %6d   (%s; only faults that hit something count)\n", total, strings.Join(faults, ", "))
	if len(r.FaultsMissed) > 0 {
		var missed []string
		for k, n := range r.FaultsMissed {
			missed = append(missed, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(missed)
		fmt.Fprintf(&b, "  faults that hit nothing       (%s: no live process, no backend, or cut short by the run's end; not counted)\n", strings.Join(missed, ", "))
	}
	fmt.Fprintf(&b, "  handler faults seen    %6d   (%d injected failures, %d injected panics in the consumers' log)\n", r.HandlerFailuresSeen+r.HandlerPanicsSeen, r.HandlerFailuresSeen, r.HandlerPanicsSeen)
	if r.DatabaseOutageSeconds > 0 {
		fmt.Fprintf(&b, "  database outage        %6.1fs  (the database refused every connection; the driver stood still; %d charges were waiting)\n", r.DatabaseOutageSeconds, r.ChargesWaitingAtOutage)
	}
	if r.HA {
		fmt.Fprintf(&b, "  clusters               3 RabbitMQ nodes (quorum queues), PostgreSQL primary + synchronous standby\n")
		fmt.Fprintf(&b, "  broker node lost       %6.1fs  (the node the connections were on, stopped and back)\n", r.BrokerNodeLostSeconds)
		fmt.Fprintf(&b, "  database failover      %6.1fs  (the primary crashed, the standby promoted; %d order attempts repeated by the driver)\n", r.FailoverSeconds, r.OrderRetries)
	}
	fmt.Fprintf(&b, "  charges                %6d   (%d provider requests: %d retries and replays absorbed by the Idempotency-Key; at most %d for one charge)\n",
		r.Charges, r.ChargeRequests, r.ChargeRequests-r.Charges, r.MaxChargeRequestsPerOrder)
	fmt.Fprintf(&b, "  mails                  %6d   (%d duplicate deliveries dropped by Message-ID)\n", r.Mails, r.MailDuplicates)
	fmt.Fprintf(&b, "  ordered audit events   %6d   (%d order violations)\n", r.AuditEvents, r.OrderViolations)
	fmt.Fprintf(&b, "  consumer stops         %6d   (rolling restarts, each process replaced first; %d partition holds met; %d effects a handler ran again, kept single by their keys)\n", r.ConsumerStops, r.PartitionHolds, r.EffectReplays)
	if r.ProducerVersion > 0 {
		fmt.Fprintf(&b, "  version roll           v1 → v%d (consumers first, old and new code at once); %d poisoned by version 1's bug, requeued under version 3\n", r.ProducerVersion, r.VersionRequeued)
	}
	fmt.Fprintf(&b, "  retries                %6d   (%d durable retries of failed handlers, %d rows that needed more than one relay attempt)\n", r.DurableRetries+r.RelayRetries, r.DurableRetries, r.RelayRetries)
	fmt.Fprintf(&b, "  poisoned               %6d   %v\n", r.Poisoned, r.PoisonReasons)
	fmt.Fprintf(&b, "  lost                   %6d\n", r.Lost)
	fmt.Fprintf(&b, "  duplicated             %6d\n", r.Duplicated)
	fmt.Fprintf(&b, "  batch route effects    %6d\n", r.BatchEffects)
	fmt.Fprintf(&b, "  effects w/o order      %6d\n", r.Orphans)
	fmt.Fprintf(&b, "  due rows left          %6d\n", r.PendingDue)
	if r.OK() {
		b.WriteString("ok: nothing lost, nothing twice\n")
	} else {
		fmt.Fprintf(&b, "FAILED (process logs kept in %s):\n", logDir)
		for _, v := range r.Violations {
			b.WriteString("  - " + v + "\n")
		}
	}
	_, _ = io.WriteString(w, b.String())
}

// logTail is the last line of each child log in dir, for an error that
// must say why without sending anyone to a temporary directory.
func logTail(dir string) string {
	files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	var tails []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if last := lines[len(lines)-1]; last != "" {
			tails = append(tails, filepath.Base(f)+": "+pipeline.CleanText(last, 400))
		}
	}
	if len(tails) == 0 {
		return "(nothing logged)"
	}
	return strings.Join(tails, " | ")
}
