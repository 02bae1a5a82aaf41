package chaos_test

import (
	"context"
	"log/slog"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/cmd/ferry/internal/chaos"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The short chaos run (CI): 1,200 orders through create_order while relay
// and consumer processes of the real binary are SIGKILLed and restarted,
// their database backends terminated, their broker connections cut, one
// process's link to the database or the broker black-holed (3 s) or reset
// (1 s) through Toxiproxy, and handlers fail (10%) and panic (1%) at random. `ferry chaos --long` is the
// long run.
//
// The CI runs are sized for CI's time: the driver, under -race, places an
// order every 30 ms or so on the shared server whatever the rate asked,
// so 2,000 orders took a minute per run, four runs. The faults come by
// the clock (every 250 ms), so 1,200 orders still meet every kind of them
// several times; `ferry chaos` runs any size.
const shortOrders = 1200

func TestChaosShort(t *testing.T) {
	rep, report := runChaos(t, chaos.ChaosRun{Orders: shortOrders, Rate: 400, FaultEvery: 250 * time.Millisecond, Seed: 42})
	require.Positive(t, rep.OrdersRolledBack)
	requireInvariants(t, shortOrders, rep, report)
}

// The CDC variant of the short run: the two relay processes stream from
// one replication slot (one active, one standing by, taking over when the
// other is killed), the walsender's backend is among those terminated, and
// the invariants are the same: nothing lost, nothing twice, order intact.
func TestChaosShortCDC(t *testing.T) {
	rep, report := runChaos(t, chaos.ChaosRun{Orders: shortOrders, Rate: 400, FaultEvery: 250 * time.Millisecond, Seed: 42, RelayMode: app.RelayModeCDC})
	require.Equal(t, app.RelayModeCDC, rep.RelayMode)
	requireInvariants(t, shortOrders, rep, report)
}

// Rolling restarts of the consumers, as a deploy makes them: three
// `ferry consume` processes, each replaced one at a time (the new one up,
// then the old one stopped) at least ten times while 1,200 orders flow, with
// charges failing before each roll (partitions held, durable retries in
// flight) and handlers failing 30% of their first tries (in-process
// retries). Stopped with SIGTERM, every process drains: no ordered event
// overtakes another, and no handler runs an effect twice. Killed with
// SIGKILL, order still holds and every effect is still made once (the
// ledger and the keys).
func TestChaosRollingRestarts(t *testing.T) {
	for _, sig := range []string{"sigterm", "sigkill"} {
		t.Run(sig, func(t *testing.T) {
			rep, report := runChaos(t, chaos.ChaosRun{Orders: shortOrders, Rate: 150, Consumers: 3, FaultEvery: 300 * time.Millisecond,
				Seed: 23, Restarts: sig, HandlerFail: 0.3, MinConsumerStops: 10})
			require.GreaterOrEqual(t, rep.ConsumerStops, 10, report)
			require.Positive(t, rep.DurableRetries, "no durable retry was in flight: %s", report)
			require.Positive(t, rep.PartitionHolds, "no ordered partition was held: %s", report)
			require.True(t, rep.OK(), report)
			require.Equal(t, rep.OrdersCommitted, rep.Charges)
			require.Equal(t, rep.OrdersCommitted, rep.Mails)
			require.Equal(t, rep.OrdersCommitted, rep.AuditEvents)
			require.Zero(t, rep.OrderViolations)
			require.Zero(t, rep.Lost)
			require.Zero(t, rep.Duplicated)
			if sig == "sigterm" {
				require.Zero(t, rep.EffectReplays, report)
				require.Positive(t, rep.StopsMetWork, "no stop met a message in a handler: %s", report)
			}
		})
	}
}

// runChaos runs a chaos run on a freshly built ferry binary.
func runChaos(t *testing.T, run chaos.ChaosRun) (chaos.ChaosReport, string) {
	t.Helper()
	rmq := pipelinetest.Rabbit(t)
	if run.RelayMode == app.RelayModeCDC {
		pipelinetest.RequireLogicalWAL(t)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Fatalf("the chaos run needs rabbitmqctl on PATH: %v", err)
	}
	run.Binary = filepath.Join(t.TempDir(), "ferry")
	build := exec.Command("go", "build", "-o", run.Binary, "github.com/ferry-dev/ferry/cmd/ferry")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building ferry: %s", out)

	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), AMQP: rmq}
	var report strings.Builder
	// A bound for a stuck run, not a target: the HA run starts three
	// RabbitMQ nodes and a primary with its standby before its first order,
	// and ran out of five minutes on two CI runs of this 2-core machine.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	started := time.Now()
	rep, err := chaos.Chaos(ctx, cfg, run, &report, slog.New(slog.DiscardHandler))
	require.NoError(t, err, "after %s; the run so far: %+v", time.Since(started).Round(time.Second), rep)
	t.Log("\n" + report.String())
	return rep, report.String()
}

// requireInvariants: every committed order charged, mailed and audited
// once, in order; every kind of fault injected; nothing lost or doubled.
func requireInvariants(t *testing.T, orders int, rep chaos.ChaosReport, report string) {
	t.Helper()
	require.True(t, rep.OK(), report)
	require.Equal(t, orders, rep.OrdersCommitted+rep.OrdersRolledBack, "every order placed")
	require.GreaterOrEqual(t, rep.OrdersCommitted, orders*9/10, "about 5% of the orders roll back")
	require.Equal(t, rep.OrdersCommitted, rep.Charges)
	require.Equal(t, rep.OrdersCommitted, rep.Mails)
	require.Equal(t, rep.OrdersCommitted, rep.BatchEffects, "the batch route counted every order once")
	require.Equal(t, rep.OrdersCommitted, rep.AuditEvents)
	for _, kind := range []string{"kill_relay", "kill_consumer", "rolling_restart", "terminate_db_backends", "close_amqp_connections", "provider_non_utf8", "network_black_hole"} {
		if kind == "network_black_hole" && rep.HA {
			continue // the clusters' URLs name several hosts: no proxies in front
		}
		require.Positive(t, rep.Faults[kind], "fault %s never injected (or never met work in flight)", kind)
	}
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.Duplicated)
	require.Zero(t, rep.OrderViolations)
}

// The database refuses every connection for 40 s while orders are placed
// (ALLOW_CONNECTIONS false on a server of the run's own, every backend
// terminated), beside the short run's faults and a provider answering in
// bytes that are not UTF-8: relays and consumers wait it out; nothing is
// poisoned but what a handler fault poisoned on purpose, nothing is lost
// or done twice, and no message loops.
func TestChaosDatabaseOutage(t *testing.T) {
	rep, report := runChaos(t, chaos.ChaosRun{Orders: 1000, Rate: 200, FaultEvery: 250 * time.Millisecond, Seed: 7, DatabaseOutage: 40 * time.Second})
	require.Equal(t, 1, rep.Faults["database_refuses_connections"], report)
	require.GreaterOrEqual(t, rep.DatabaseOutageSeconds, 40.0)
	require.GreaterOrEqual(t, rep.ChargesWaitingAtOutage, 50, "the outage met consumers with work to do")
	require.True(t, rep.OK(), report)
	require.Equal(t, rep.OrdersCommitted, rep.Charges)
	require.Equal(t, rep.OrdersCommitted, rep.Mails)
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.Duplicated)
	require.Positive(t, rep.Faults["provider_non_utf8"])
}

// The short HA run (CI): the chaos run on clusters of its own — three
// RabbitMQ nodes with quorum queues, a PostgreSQL primary with a
// synchronous standby — with the broker node the pipeline's connections
// are on stopped for 5 s and a database failover among the faults: nothing
// lost, nothing twice, order intact. `ferry chaos --ha --long` is the long run.
func TestChaosHA(t *testing.T) {
	const orders = 3000
	rep, report := runChaos(t, chaos.ChaosRun{Orders: orders, Rate: 200, FaultEvery: 250 * time.Millisecond, Seed: 11, HA: true})
	require.Equal(t, 1, rep.Faults["broker_node_lost"], report)
	require.Equal(t, 1, rep.Faults["database_failover"], report)
	requireInvariants(t, orders, rep, report)
}

// The version roll (CI): 4,000 orders while the charge event goes from
// version 1 to 2 to 3 (new code up before the old stops: both read one
// queue): to version 2 the consumers roll first, to version 3 the
// producers do, so that version 2's code reads version 3 events through
// the down step it shipped (without it they would be poisoned). Version
// 1's code poisons the charges of a multiple of 97 (a bug); once version
// 3 runs everywhere they are requeued, as version 1 events, and succeed.
// Nothing is poisoned for its version, lost or done twice.
func TestChaosEventVersions(t *testing.T) {
	// Two consumer processes, as the short runs: during a roll three run
	// at once, each with its pool, beside the other packages' tests on
	// the shared server (max_connections 100; CI once saw "too many
	// clients" with three).
	// 4,000 orders: each version's window still holds about 1,600, and
	// version 1's about 16 poisoned charges (a multiple of 97). With 10,000
	// the run took 2.5 minutes alone and twice that in CI's full suite.
	rep, report := runChaos(t, chaos.ChaosRun{Orders: 4_000, Rate: 250, Consumers: 2, Seed: 35, Versions: true})
	require.True(t, rep.OK(), report)
	require.Equal(t, 3, rep.ProducerVersion, report)
	require.Equal(t, 1, rep.Faults["version_consumers_v2"], report)
	require.Equal(t, 1, rep.Faults["version_consumers_v3"], report)
	require.GreaterOrEqual(t, rep.ConsumerStops, 4, "each roll replaced every consumer: %s", report)
	require.Positive(t, rep.VersionRequeued, report)
	require.Positive(t, rep.VersionAhead, "a down-conversion window: %s", report)
	require.GreaterOrEqual(t, rep.OrdersCommitted, 3600)
	require.Equal(t, rep.OrdersCommitted, rep.Charges)
	require.Equal(t, rep.OrdersCommitted, rep.Mails)
	require.Zero(t, rep.Poisoned, "requeued and handled: %s", report)
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.Duplicated)
	require.Zero(t, rep.OrderViolations)
}

// Faults the network makes (CI): two `ferry run` processes, A and B, one
// schema and one vhost, each reaching PostgreSQL and RabbitMQ through
// Toxiproxy proxies of its own; orders at 20/s while, in turn, A's broker
// links are black-holed for 45 s, B's database answers 300 ± 200 ms late
// for 30 s, B's database links are black-holed for 20 s (B holds every
// ordered partition by then: it must hand them over) and A's broker
// connections are reset for 4 s. Each fault met the sick process with a
// transaction open. Every committed order charged once and mailed once,
// nothing poisoned, nothing pending, order kept on the ordered topic, and
// the orders committed during a black hole or the resets charged within
// chaos.NetworkBound (p99): the healthy process does the sick one's work.
// `ferry chaos --network` adds slow closes, bandwidth and more kinds;
// with --long it runs 10 minutes.
func TestChaosNetwork(t *testing.T) {
	rep, report := runChaos(t, chaos.ChaosRun{Rate: 20, Seed: 51, Network: true, NetworkShort: true})
	require.True(t, rep.OK(), report)
	for _, kind := range []string{"broker_black_hole", "db_latency", "db_black_hole", "broker_resets"} {
		require.Equal(t, 1, rep.Faults[kind], "fault %s: %s", kind, report)
	}
	for _, nf := range rep.Network {
		require.True(t, nf.MetWork, "%s on %s met no work in flight: %s", nf.Kind, nf.Process, report)
		require.Equal(t, nf.Kind != "db_latency", nf.Bounded, nf.Kind)
		if nf.Bounded {
			require.LessOrEqual(t, nf.P99, chaos.NetworkBound.Seconds(), report)
		}
	}
	require.Equal(t, rep.OrdersCommitted, rep.Charges)
	require.Equal(t, rep.OrdersCommitted, rep.Mails)
	require.Equal(t, rep.OrdersCommitted, rep.AuditEvents)
	require.Zero(t, rep.Poisoned, report)
	require.Zero(t, rep.PendingDue, report)
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.Duplicated)
	require.Zero(t, rep.OrderViolations)
}

// The tenants run (CI): one fleet of two `ferry run` processes over four
// tenant databases on two PostgreSQL servers of the run's own, orders
// placed in each tenant's database for 40 s while members are killed and
// rolled, the fleet's tenant sessions terminated, its broker connections
// cut and handlers fail and panic; a tenant is added, one paused and
// resumed, one drained and removed, and server B is killed for 8 s. Per
// tenant: every committed order charged, mailed and audited once, in
// order, each ledger row in its own tenant's database; server A's tenants
// charged while B was down, none (p99) later than in the quiet moment
// before B died and chaos.TenantOutageSlack. `ferry chaos
// --tenants --long` runs 10 minutes.
func TestChaosTenants(t *testing.T) {
	rmq := pipelinetest.Rabbit(t)
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Fatalf("the chaos run needs rabbitmqctl on PATH: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "ferry")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/ferry-dev/ferry/cmd/ferry").CombinedOutput()
	require.NoError(t, err, "building ferry: %s", out)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	var report strings.Builder
	rep, err := chaos.ChaosTenants(ctx, app.Config{DatabaseURL: pipelinetest.DatabaseURL(), AMQP: rmq},
		chaos.TenantsRun{Tenants: 4, Rate: 24, Duration: 40 * time.Second, ServerDown: 8 * time.Second, FaultEvery: time.Second, Seed: 61, Binary: bin},
		&report, slog.New(slog.DiscardHandler))
	require.NoError(t, err, "the run so far: %+v", rep)
	t.Log("\n" + report.String())
	require.True(t, rep.OK(), report.String())
	for _, kind := range []string{"tenant_added", "tenant_paused", "tenant_removed", "tenant_server_killed", "kill_member", "roll_members", "terminate_tenant_backends", "close_amqp_connections"} {
		require.Positive(t, rep.Faults[kind], "fault %s never injected: %s", kind, report.String())
	}
	require.Len(t, rep.Tenants, 4)
	for _, tr := range rep.Tenants {
		require.Positive(t, tr.Committed, "tenant %s: %s", tr.ID, report.String())
		require.LessOrEqual(t, tr.Charges, tr.Committed, tr.ID)
		require.LessOrEqual(t, tr.Committed-tr.Charges, tr.Poisoned, "tenant %s: a charge missing and not poisoned", tr.ID)
		require.LessOrEqual(t, tr.Committed-tr.BatchEffects, tr.Poisoned, "tenant %s: an order the batch route missed, not poisoned", tr.ID)
		require.Zero(t, tr.Lost, tr.ID)
		require.Zero(t, tr.Duplicated, tr.ID)
		require.Zero(t, tr.Crossed, tr.ID)
		require.Zero(t, tr.OrderViolations, tr.ID)
		require.Zero(t, tr.PendingDue, tr.ID)
		require.GreaterOrEqual(t, tr.LedgerRows, 3*tr.Committed, "tenant %s: its ledger holds its charges, mails and audit events", tr.ID)
	}
	require.Positive(t, rep.HandlerFailuresSeen, report.String())
	require.Zero(t, rep.ControlLedgerRows)
	require.Positive(t, rep.OutageOrders, "server A's tenants placed orders while B was down: %s", report.String())
	require.LessOrEqual(t, rep.OutageP99, rep.BeforeP99+chaos.TenantOutageSlack.Seconds(), report.String())
}
