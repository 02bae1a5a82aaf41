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
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

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
	// Network makes faults of the network the run's only faults
	// (chaos_network.go): two `ferry run` processes, A and B, each behind
	// Toxiproxy proxies of its own to PostgreSQL and RabbitMQ; black holes,
	// latency, resets, slow closes and bandwidth limits strike one process's
	// link at a time. Handlers do not fail on purpose, nothing may be
	// poisoned, and the orders committed during a fault must be charged
	// within NetworkBound. Orders are placed until the plan ends.
	Network bool
	// NetworkShort keeps the network plan to its first four faults (the CI
	// run); NetworkDuration, if set, draws further faults until the plan
	// lasts that long (the long run: 10 minutes).
	NetworkShort    bool
	NetworkDuration time.Duration
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
	if r.Network {
		// Orders until the plan's last fault is over; no handler faults:
		// a poisoned message is the network's doing, and a violation.
		r.Orders = max(r.Orders, int(planDuration(networkPlan(r)).Seconds())*r.Rate)
		r.HandlerFail, r.HandlerPanic = 0, 0
		r.Relays, r.Consumers = 0, 0
	}
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
	// FaultsMetWork counts, by kind, the faults that met work in flight
	// (the network run's: NetworkFault.MetWork).
	FaultsMetWork map[string]int `json:"faults_met_work,omitempty"`
	// Network is the network run's faults, each with the delays of the
	// orders committed while it lasted; NetworkBoundSeconds is their bound.
	Network             []NetworkFault `json:"network_faults,omitempty"`
	NetworkBoundSeconds float64        `json:"network_bound_seconds,omitempty"`
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
	// StopsMetWork is how many graceful consumer stops began with messages
	// in handlers (app.DrainingLog, one per queue): a stop that met
	// nothing proves nothing about the drain.
	StopsMetWork int `json:"stops_met_work_in_flight"`
	// VersionRequeued is how many messages the version roll requeued from
	// the poison store after version 3 was deployed (version 1's bug).
	VersionRequeued int `json:"version_requeued"`
	// ProducerVersion is the charge event version the driver published
	// last (the version roll moves it to 3).
	ProducerVersion int `json:"producer_version,omitempty"`
	// VersionAhead is how many orders the driver published at a version
	// newer than the consumers' (the roll to version 3 takes the producers
	// first): version 2's code read them through its down step.
	VersionAhead int `json:"version_ahead_of_consumers"`
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
	if err := run.validate(); err != nil {
		return ChaosReport{}, err
	}
	rep = ChaosReport{Seed: run.Seed, RelayMode: run.RelayMode, HA: run.HA, Faults: map[string]int{}, FaultsMissed: map[string]int{}, FaultsMetWork: map[string]int{}, PoisonReasons: map[string]int{}}
	rng := rand.New(rand.NewPCG(run.Seed, run.Seed+1))
	id, err := begin(&run.Binary, &logger)
	if err != nil {
		return rep, err
	}
	schema, vhost, appName := "ferry_chaos_"+id, "ferry_chaos_"+id, "ferry-chaos-"+id
	var cl cleanups
	defer cl.run()
	srv, err := startServers(ctx, &cfg, run, &cl)
	if err != nil {
		return rep, fmt.Errorf("starting the run's servers: %w", err)
	}
	provider, sink, err := startWorld(&cl)
	if err != nil {
		return rep, err
	}
	driver, svc, c, err := startDriver(ctx, cfg, run, schema, vhost, appName, provider, sink, logger, &cl)
	if err != nil {
		return rep, fmt.Errorf("starting the driver: %w", err)
	}

	var links *linkProxies
	if !run.HA && !run.Versions && run.Restarts == "" {
		// The network faults (the network run's, the default mix's): each
		// child behind proxies of its own.
		if links, err = newLinkProxies(cfg.DatabaseURL, c.AMQP.URL, &cl); err != nil {
			return rep, fmt.Errorf("starting the run's Toxiproxy: %w", err)
		}
	}
	env, childFaults, err := startChildren(ctx, cfg, c, run, schema, appName, provider, sink, driver, links, logger, &cl)
	if err != nil {
		return rep, fmt.Errorf("starting the relay and consumer processes: %w", err)
	}
	logDir := env.logDir

	faults := startFaults(ctx, run, env, driver, provider, srv, vhost, appName, childFaults, &rep)
	committedAt := map[int64]time.Time{}
	seq, committedKeys, err := placeOrders(ctx, run, rng, driver, svc, faults.retried, env, committedAt, &rep)
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
	if run.Network {
		checkNetwork(&rep, faults.windows, committedAt, provider.Charges(), logDir)
		// A process that loses a link waits it out: it must not exit.
		if live := len(env.live("run")); live < len(networkProcesses) {
			rep.Violations = append(rep.Violations, fmt.Sprintf("%d of the %d `ferry run` processes exited during the network faults (their logs: %s)",
				len(networkProcesses)-live, len(networkProcesses), logTail(logDir)))
		}
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
		var err error
		if c.AMQP.URL, err = ownVhost(ctx, cfg.AMQP.URL, vhost, cl); err != nil {
			return nil, nil, c, err
		}
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

// begin sets what a run starts from: the binary its children run (this
// process's executable unless set), a logger (discarding unless set); it
// returns the run's id, which names its schema, vhost and sessions.
func begin(binary *string, logger **slog.Logger) (string, error) {
	if *binary == "" {
		var err error
		if *binary, err = os.Executable(); err != nil {
			return "", err
		}
	}
	if *logger == nil {
		*logger = slog.New(slog.DiscardHandler)
	}
	return fmt.Sprintf("%d", time.Now().UnixNano()), nil
}

// startWorld starts the sandbox's payment provider and SMTP sink, closed
// when the run ends.
func startWorld(cl *cleanups) (*sandbox.PaymentProvider, *sandbox.SMTPSink, error) {
	world, err := sandbox.StartWorld()
	if err != nil {
		return nil, nil, err
	}
	cl.add(func() { world.Close() })
	return world.Payments, world.SMTP, nil
}

// ownVhost adds vhost to the broker of amqpURL, with the URL's user
// allowed everything in it, deleted when the run ends, and returns the URL
// of the vhost.
func ownVhost(ctx context.Context, amqpURL, vhost string, cl *cleanups) (string, error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", err
	}
	if err := rabbitmqctl(ctx, "add_vhost", vhost); err != nil {
		return "", err
	}
	cl.add(func() { _ = rabbitmqctl(context.WithoutCancel(ctx), "delete_vhost", vhost) })
	if err := rabbitmqctl(ctx, "set_permissions", "-p", vhost, u.User.Username(), ".*", ".*", ".*"); err != nil {
		return "", err
	}
	u.Path = "/" + vhost
	return u.String(), nil
}

// childSettings are every run's children's settings beyond where their
// servers are: short waits, so that a fault's effects show within a run.
var childSettings = []string{
	"FERRY_ADMIN_ADDR=off", "FERRY_LOG_FORMAT=json", "FERRY_LOG_LEVEL=info",
	"FERRY_RELAY_POLL_INTERVAL=100ms", "FERRY_RELAY_BACKOFF_INITIAL=200ms", "FERRY_RELAY_BACKOFF_MAX=2s",
	"FERRY_DURABLE_RETRY_INITIAL=200ms", "FERRY_DURABLE_RETRY_MAX=2s", "FERRY_DURABLE_RETRY_MAX_ATTEMPTS=10",
	"FERRY_RETRY_INITIAL_INTERVAL=10ms", "FERRY_RETRY_MAX_INTERVAL=50ms", "FERRY_SHUTDOWN_TIMEOUT=10s",
}

// startChildren is the third phase: the relays and consumers as separate
// processes of the binary, with the run's configuration, up and
// heartbeating. faults gives each child its own handler-fault seed; cl
// stops the children (and drops a CDC run's slot) when the run ends.
func startChildren(ctx context.Context, cfg, c app.Config, run ChaosRun, schema, appName string, provider *sandbox.PaymentProvider, sink *sandbox.SMTPSink,
	driver *app.App, links *linkProxies, logger *slog.Logger, cl *cleanups) (*chaosEnv, func() string, error) {
	logDir, err := os.MkdirTemp("", "ferry-chaos-")
	if err != nil {
		return nil, nil, err
	}
	env := &chaosEnv{bin: run.Binary, logDir: logDir, logger: logger, links: links, appName: appName, env: append([]string{
		"FERRY_DATABASE_URL=" + cfg.DatabaseURL, "FERRY_DATABASE_SCHEMA=" + schema, "FERRY_DATABASE_APP_NAME=" + appName,
		"FERRY_AMQP_URL=" + c.AMQP.URL, "FERRY_AMQP_NAMESPACE=",
		"FERRY_PAYMENT_URL=" + provider.URL(), "FERRY_SMTP_ADDR=" + sink.Addr(),
	}, childSettings...)}
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
	wantRelays, wantConsumers := run.Relays, run.Consumers
	if run.Network {
		// The network run's processes: `ferry run` each, through its
		// proxies, with an API on a free port.
		for _, name := range networkProcesses {
			proc, err := env.startAs(name, "run", "FERRY_HTTP_ADDR=127.0.0.1:0", faults())
			if err != nil {
				return nil, nil, err
			}
			env.network = append(env.network, proc)
		}
		wantRelays, wantConsumers = len(networkProcesses), len(networkProcesses)
	}
	if err := wait.For(ctx, func() bool {
		var relays, consumers int
		_ = driver.Pool().QueryRow(ctx, `SELECT count(*) FILTER (WHERE components LIKE '%relay%'), count(*) FILTER (WHERE components LIKE '%consumers%') FROM ferry_instances`).Scan(&relays, &consumers)
		return relays >= wantRelays && consumers >= wantConsumers
	}); err != nil {
		return nil, nil, fmt.Errorf("children did not come up: %w; their last words: %s (logs in %s)", err, logTail(logDir), logDir)
	}
	return env, faults, nil
}

// placeOrders is the driver's part while the faults run: orders at a
// steady rate, some rolled back after publishing, some replayed by a client
// retrying after a timeout (which must be deduplicated). retried runs each
// beside the database outage. It returns the audit events expected per
// aggregate and the committed orders' keys.
func placeOrders(ctx context.Context, run ChaosRun, rng *rand.Rand, driver *app.App, svc *orders.Service,
	retried func(fn func() error, retries *int) error, env *chaosEnv, committedAt map[int64]time.Time, rep *ChaosReport) (map[string]int64, []string, error) {
	consumersAt := func() int {
		v, _ := env.version.Load().(string)
		n, _ := strconv.Atoi(v)
		return n
	}
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
		env.placed.Store(int64(i))
		if run.Versions && (i == run.Orders*2/5 || i == run.Orders*3/5) {
			// The producers follow the consumers to version 2 (at two
			// fifths; the consumers rolled at one) and go ahead of them to
			// version 3 (at three fifths; the consumers roll at four), as
			// a deploy of producers first does: version 2's code reads
			// version 3 events through the down step it shipped.
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
		var orderID int64
		err := retried(func() (err error) {
			orderID, err = chaosOrder(ctx, driver, svc, in, seq, rollback)
			return err
		}, &rep.OrderRetries)
		if err != nil {
			return seq, committedKeys, fmt.Errorf("placing order %d: %w", i, err)
		}
		if rollback {
			rep.OrdersRolledBack++
			continue
		}
		rep.OrdersCommitted++
		committedAt[orderID] = time.Now()
		committedKeys = append(committedKeys, in.IdempotencyKey)
		if run.Versions && rep.ProducerVersion > consumersAt() {
			rep.VersionAhead++
		}
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
		// Only those: a message poisoned for anything else (an event a
		// version's code could not read: a down step missing) stays
		// poisoned and fails the run.
		res, err := driver.Poison().Requeue(dctx, pgpoison.Selector{Filter: pgpoison.Filter{Text: VersionBugText}}, pgpoison.Run{Actor: "ferry chaos"})
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
		rep.StopsMetWork = strings.Count(string(b), app.DrainingLog)
	}
	rep.HandlerFailuresSeen, rep.HandlerPanicsSeen = handlerFaultsSeen(filepath.Join(logDir, "consume.log"), run.HandlerFail, run.HandlerPanic, &rep.Violations)
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
	if r.Network && (r.Versions || r.Restarts != "" || r.HA || r.DatabaseOutage > 0 || r.RestartBroker || r.RelayMode == app.RelayModeCDC) {
		return errors.New("a network run has no other faults: not with a version roll, rolling restarts, HA, a database outage, broker restarts or the CDC relay")
	}
	if r.HA && (r.DatabaseOutage > 0 || r.RestartBroker || r.RelayMode == app.RelayModeCDC) {
		return errors.New("the HA run has its own database and broker faults: not with a database outage, broker restarts or the CDC relay")
	}
	return nil
}

// chaosOrder places one order with its audit event in one transaction, or
// rolls the transaction back after publishing.
func chaosOrder(ctx context.Context, a *app.App, svc *orders.Service, in orders.Input, seq map[string]int64, rollback bool) (orderID int64, _ error) {
	tx, err := a.DB().BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback()
	res, err := svc.CreateOrderTx(ctx, tx, in)
	if err != nil {
		return 0, err
	}
	if res.Deduped {
		// A retry of an order whose commit went through though its answer
		// was lost (a crash mid-commit): its audit event committed with it.
		seq[in.UserID]++
		return res.OrderID, nil
	}
	evt, err := pipeline.NewEvent(ctx, in.UserID, ChaosAudit{Aggregate: in.UserID, Seq: seq[in.UserID]})
	if err != nil {
		return 0, err
	}
	if err := a.Outbox().PublishEventsTx(ctx, tx, pipeline.Outgoing{Topic: ChaosAuditTopic, Msg: evt}); err != nil {
		return 0, err
	}
	if rollback {
		return res.OrderID, tx.Rollback()
	}
	if err := tx.Commit(); err != nil {
		return 0, err
	}
	a.Outbox().Committed()
	seq[in.UserID]++
	return res.OrderID, nil
}
