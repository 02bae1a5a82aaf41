package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing/fstest"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
)

// ScenarioTenants is one fleet process (FERRY_TENANTS) over --tenants
// tenants, each a schema of the shared database: the quiet tenants commit
// one event a second each, alone, then while the first tenant drains a
// backlog of --tenant-backlog events; their commit → effect latency in
// both rounds (issue 52's goal: p99 with the noisy neighbour within 2× of
// p99 without), the connections the process holds, and what the fleet
// costs with every tenant idle (goal: under 5 % of one core).
const ScenarioTenants = "tenants"

var benchEffects = migrations.Set{Name: "bench-effects", VersionTable: "bench_effects_versions", FS: fstest.MapFS{
	"00001_effects.sql": {Data: []byte("-- +goose Up\nCREATE TABLE bench_effects (order_id text NOT NULL);\n-- +goose Down\nDROP TABLE bench_effects;\n")},
}}

type tenantOrder struct {
	ID string `json:"id"`
	At int64  `json:"at"` // unix ns, just before the commit
}

func benchTenants(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	control, drop, err := newAppSchema(ctx, cfg)
	if err != nil {
		return benchReport{}, err
	}
	defer drop()
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, ApplicationName: "ferry-bench-admin", MaxConns: 8})
	if err != nil {
		return benchReport{}, err
	}
	defer admin.Close()

	// The tenants' schemas, migrated four at a time.
	prefix := fmt.Sprintf("ferry_bench_%d_t", time.Now().UnixNano())
	schemas := make([]string, bc.Tenants)
	for i := range schemas {
		schemas[i] = fmt.Sprintf("%s%03d", prefix, i)
	}
	defer func() {
		for _, s := range schemas {
			_ = pgdb.DropSchema(context.WithoutCancel(ctx), admin, s)
		}
	}()
	setupStart := time.Now()
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(4)
	for _, s := range schemas {
		g.Go(func() error { return migrateBenchTenant(gctx, cfg.DatabaseURL, s) })
	}
	if err := g.Wait(); err != nil {
		return benchReport{}, err
	}
	setup := time.Since(setupStart)

	var (
		mu          sync.Mutex
		quiet       latencies
		confirmed   latencies // commit → broker confirm, the relay's part
		noisyDone   atomic.Int64
		measuring   atomic.Bool
		handlerErrs atomic.Int64
	)
	routes := func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "bench.tenants", Topic: "bench.tenants", Handler: func(msg *message.Message) error {
			var o tenantOrder
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return pipeline.Permanent(err)
			}
			tx := pgledger.TxFromContext(msg.Context())
			if _, err := tx.Exec(msg.Context(), `INSERT INTO bench_effects (order_id) VALUES ($1)`, o.ID); err != nil {
				handlerErrs.Add(1)
				return err
			}
			if o.At == 0 {
				noisyDone.Add(1)
			} else if measuring.Load() {
				d := time.Since(time.Unix(0, o.At))
				mu.Lock()
				quiet = append(quiet, d)
				mu.Unlock()
			}
			return nil
		}}}, nil
	}
	c := cfg
	c.Relay.Observer = func(outcomes []pgoutbox.Outcome) {
		if !measuring.Load() {
			return
		}
		for _, o := range outcomes {
			var q tenantOrder
			if o.Err != nil || o.Msg == nil || json.Unmarshal(o.Msg.Payload, &q) != nil || q.At == 0 {
				continue
			}
			mu.Lock()
			confirmed = append(confirmed, o.At.Sub(time.Unix(0, q.At)))
			mu.Unlock()
		}
	}
	c.DatabaseSchema = control
	c.AdminAddr = "off"
	c.Tenants = true
	c.AMQP.Namespace = fmt.Sprintf("ferrybench%d.", time.Now().UnixNano())
	a, err := app.New(ctx, c, app.Options{Logger: logger, Routes: routes})
	if err != nil {
		return benchReport{}, err
	}
	defer a.Close()
	defer func() { _ = a.Topology().Teardown(a.Broker()) }()
	for i, s := range schemas {
		if err := pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: fmt.Sprintf("t%03d", i), Schema: s}, "ferry-bench"); err != nil {
			return benchReport{}, err
		}
	}
	stop, err := a.Start(ctx, app.Components{Relay: true, Consumers: true})
	if err != nil {
		return benchReport{}, err
	}
	defer stop()
	time.Sleep(2 * a.Config().Fleet.Reload) // every tenant served

	// The quiet tenants' producers: one event a second each, spread over
	// the second, committed through one pool into each tenant's outbox
	// (named with its schema), announced as a program without Ferry's
	// pool does it (pg_notify with the schema).
	producers, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, ApplicationName: "ferry-bench-producers", MaxConns: 8})
	if err != nil {
		return benchReport{}, err
	}
	defer producers.Close()
	outboxes := make([]*pgoutbox.Outbox, len(schemas))
	for i, s := range schemas {
		tbl, err := pgoutbox.Table{}.InSchema(s)
		if err != nil {
			return benchReport{}, err
		}
		if outboxes[i], err = pgoutbox.New(pgoutbox.Config{Table: tbl}, nil); err != nil {
			return benchReport{}, err
		}
	}
	seq := 0
	quietRound := func(d time.Duration) (map[string]float64, error) {
		mu.Lock()
		quiet, confirmed = nil, nil
		mu.Unlock()
		measuring.Store(true)
		defer measuring.Store(false)
		cpu0 := readCPU()
		n := len(schemas) - 1
		tick := time.NewTicker(time.Second / time.Duration(n))
		defer tick.Stop()
		end := time.Now().Add(d)
		placed := 0
		for time.Now().Before(end) {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-tick.C:
			}
			i := 1 + seq%n
			seq++
			o := tenantOrder{ID: fmt.Sprintf("q-%d", seq), At: time.Now().UnixNano()}
			err := pgx.BeginFunc(ctx, producers, func(tx pgx.Tx) error {
				if err := outboxes[i].Publish(ctx, tx, "bench.tenants", o.ID, o); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, pgoutbox.NotifyChannel, schemas[i])
				return err
			})
			if err != nil {
				return nil, err
			}
			placed++
		}
		deadline := time.Now().Add(time.Minute)
		for {
			mu.Lock()
			got := len(quiet)
			mu.Unlock()
			if got >= placed || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		mu.Lock()
		defer mu.Unlock()
		s := quiet.summary()
		s["placed"] = float64(placed)
		// Where the quiet tenants' latency goes beside a backlog: a
		// machine with no core left (the drain's relay, consumers,
		// PostgreSQL and RabbitMQ) delays every handler alike.
		s["machine_cpu_busy"] = readCPU().busySince(cpu0)
		cs := confirmed.summary()
		s["to_confirm_p50_ms"], s["to_confirm_p99_ms"] = cs["p50_ms"], cs["p99_ms"]
		return s, nil
	}

	// A round first, not counted: each tenant's first batches (its
	// relay built, its failover checked, the statements prepared in its
	// schema) are the start's, not the steady load's.
	if _, err := quietRound(min(bc.Duration, 10*time.Second)); err != nil {
		return benchReport{}, err
	}
	alone, err := quietRound(bc.Duration)
	if err != nil {
		return benchReport{}, err
	}

	// The noisy neighbour: a backlog committed at once.
	noisyTable, _ := pgoutbox.Table{}.InSchema(schemas[0])
	loadStart := time.Now()
	if _, err := admin.Exec(ctx, `INSERT INTO `+noisyTable.Quoted()+` (message_uuid, aggregate_id, topic, payload, headers, part)
		SELECT gen_random_uuid()::text, 'n-' || g, 'bench.tenants', jsonb_build_object('id', 'n-' || g), '{}', `+pgx.Identifier{schemas[0]}.Sanitize()+`.ferry_outbox_part(now())
		FROM generate_series(1, $1) g`, bc.TenantBacklog); err != nil {
		return benchReport{}, fmt.Errorf("loading the noisy tenant's backlog: %w", err)
	}
	load := time.Since(loadStart)
	if _, err := admin.Exec(ctx, `SELECT pg_notify($1, $2)`, pgoutbox.NotifyChannel, schemas[0]); err != nil {
		return benchReport{}, err
	}
	time.Sleep(2 * time.Second) // the drain under way
	var maxConns atomic.Int64
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampleCtx.Err() == nil {
			var n int64
			if err := admin.QueryRow(sampleCtx, `SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1 || '%'`, c.DatabaseAppName).Scan(&n); err == nil && n > maxConns.Load() {
				maxConns.Store(n)
			}
			select {
			case <-sampleCtx.Done():
			case <-time.After(500 * time.Millisecond):
			}
		}
	}()
	drained0, drainStart := noisyDone.Load(), time.Now()
	withNoisy, err := quietRound(bc.Duration)
	drainRate := float64(noisyDone.Load()-drained0) / time.Since(drainStart).Seconds()
	stopSampling()
	<-sampled
	if err != nil {
		return benchReport{}, err
	}

	// Every tenant idle: the backlog's rest removed, the queue drained.
	if _, err := admin.Exec(ctx, `TRUNCATE `+noisyTable.Quoted()); err != nil {
		return benchReport{}, err
	}
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); {
		stats, err := a.QueueStats(ctx)
		ready := 0
		for _, s := range stats {
			ready += s.Ready
		}
		if err == nil && ready == 0 {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(max(a.Config().Fleet.Pools.IdleAfter, 5*time.Second) + 2*time.Second) // connections idle out
	backends, err := ownBackends(ctx, admin, serverPort(c.DatabaseURL))
	if err != nil {
		return benchReport{}, err
	}
	pools, tenantConns, listeners := a.TenantConnections()
	pg0 := make(map[int]uint64, len(backends))
	for _, pid := range backends {
		pg0[pid] = onCPU(pid)
	}
	self0, t0 := onCPU(os.Getpid()), time.Now()
	select {
	case <-ctx.Done():
		return benchReport{}, ctx.Err()
	case <-time.After(bc.Duration):
	}
	// A backend that ended meanwhile (a connection idle past
	// FERRY_TENANT_IDLE_AFTER) takes its time with it: the backends
	// still there are summed (a lower bound when one ended).
	var pgUsed uint64
	for pid, before := range pg0 {
		if now := onCPU(pid); now >= before {
			pgUsed += now - before
		}
	}
	self1, elapsed := onCPU(os.Getpid()), time.Since(t0).Seconds()
	perSecond := func(ns uint64) float64 { return math.Round(10*float64(ns)/1e6/elapsed) / 10 }
	idleSelf, idlePG := perSecond(self1-self0), perSecond(pgUsed)
	idleTotal := math.Round((idleSelf+idlePG)*10) / 10

	ratio := 0.0
	if alone["p99_ms"] > 0 {
		ratio = math.Round(100*withNoisy["p99_ms"]/alone["p99_ms"]) / 100
	}
	js := map[string]any{
		"tenants": bc.Tenants, "backlog": bc.TenantBacklog, "seconds_per_round": bc.Duration.Seconds(),
		"setup_seconds": math.Round(setup.Seconds()), "backlog_load_seconds": math.Round(load.Seconds()),
		"quiet_alone": alone, "quiet_with_noisy": withNoisy, "p99_ratio": ratio, "p99_ratio_goal_max": 2.0, "p99_ratio_met": ratio > 0 && ratio <= 2,
		"noisy_drain_per_s": math.Round(drainRate), "max_connections": maxConns.Load(),
		"idle": map[string]any{"process_ms_per_s": idleSelf, "postgresql_ms_per_s": idlePG, "total_ms_per_s": idleTotal,
			"percent_of_a_core": math.Round(idleTotal) / 10, "goal_percent_max": 5.0, "met": idleTotal < 50,
			"open_tenant_pools": pools, "tenant_connections": tenantConns, "listen_connections": listeners, "backends": len(backends)},
		"handler_errors": handlerErrs.Load(),
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "%d tenants (schemas, migrated in %s); quiet tenants at 1 event/s each, %s a round\n", bc.Tenants, setup.Round(time.Second), bc.Duration)
	fmt.Fprintf(&tb, "%-34s %8s %8s %8s %8s %14s %14s\n", "commit → effect", "count", "p50 ms", "p99 ms", "max ms", "→confirm p50", "→confirm p99")
	for _, r := range []struct {
		name string
		s    map[string]float64
	}{{"quiet tenants alone", alone}, {fmt.Sprintf("with a %d-event backlog beside", bc.TenantBacklog), withNoisy}} {
		fmt.Fprintf(&tb, "%-34s %8.0f %8.2f %8.2f %8.2f %14.2f %14.2f\n", r.name, r.s["count"], r.s["p50_ms"], r.s["p99_ms"], r.s["max_ms"], r.s["to_confirm_p50_ms"], r.s["to_confirm_p99_ms"])
	}
	fmt.Fprintf(&tb, "p99 ratio %.2f (goal ≤ 2); the backlog drained at %.0f events/s meanwhile; at most %d connections of this process; machine CPU busy %.0f %% alone, %.0f %% beside the backlog\n",
		ratio, drainRate, maxConns.Load(), 100*alone["machine_cpu_busy"], 100*withNoisy["machine_cpu_busy"])
	fmt.Fprintf(&tb, "idle, every tenant: %.1f ms/s (%.1f %% of a core; goal < 5 %%): process %.1f, PostgreSQL %.1f; %d tenant pools open holding %d connections, %d LISTEN connections\n",
		idleTotal, idleTotal/10, idleSelf, idlePG, pools, tenantConns, listeners)
	if n := handlerErrs.Load(); n > 0 {
		return benchReport{JSON: js, Table: tb.String()}, errors.New("handlers failed: see the log")
	}
	return benchReport{JSON: js, Table: tb.String()}, nil
}

func migrateBenchTenant(ctx context.Context, url, schema string) error {
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: url, Schema: schema, ApplicationName: "ferry-bench-migrate", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgdb.EnsureSchema(ctx, pool, schema); err != nil {
		return err
	}
	db := pgdb.SQLDB(pool)
	defer db.Close()
	for _, set := range []migrations.Set{migrations.Library, benchEffects} {
		if _, err := set.Up(ctx, db); err != nil {
			return fmt.Errorf("migrating %s: %w", schema, err)
		}
	}
	return nil
}
