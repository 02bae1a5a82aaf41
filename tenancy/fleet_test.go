package tenancy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/tenancy"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// effects is the tenants' own table: the handler's business write.
var effects = migrations.Set{Name: "effects", VersionTable: "effects_versions", FS: fstest.MapFS{
	"00001_effects.sql": {Data: []byte(`-- +goose Up
CREATE TABLE effects (order_id text NOT NULL, tenant text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
-- +goose Down
DROP TABLE effects;
`)},
}}

type order struct {
	ID string `json:"id"`
}

// effectRoute writes the effect in the ledger's transaction: in a tenant
// fleet, the database of the event's tenant.
func effectRoute(app.Deps) ([]handlers.Route, error) {
	return []handlers.Route{{Name: "tenants.effect", Topic: "tenants.order_placed", Handler: writeEffect}}, nil
}

func writeEffect(msg *message.Message) error {
	var o order
	if err := json.Unmarshal(msg.Payload, &o); err != nil {
		return pipeline.Permanent(err)
	}
	tx := pgledger.TxFromContext(msg.Context())
	_, err := tx.Exec(msg.Context(), `INSERT INTO effects (order_id, tenant) VALUES ($1, $2)`, o.ID, pipeline.TenantIDFromContext(msg.Context()))
	return err
}

// tenantDB is a tenant's database as its own service sees it: a pool
// whose commits of events wake the fleet (the recipe of docs/tenants.md).
type tenantDB struct {
	id, url string
	pool    *pgxpool.Pool
	outbox  *pgoutbox.Outbox
	placed  []string
}

func openTenant(t *testing.T, ctx context.Context, id, url string) *tenantDB {
	t.Helper()
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: url, ApplicationName: "ferry-test-migrate"})
	require.NoError(t, err)
	db := pgdb.SQLDB(admin)
	for i, set := range []migrations.Set{migrations.Library, effects} {
		_, err := set.Up(ctx, db)
		require.NoError(t, err, "migrating tenant %s", id)
		if i == 0 {
			tbl, err := ferrytest.OutboxTable()
			require.NoError(t, err)
			require.NoError(t, ferrytest.RenameOutbox(ctx, admin, tbl))
		}
	}
	db.Close()
	admin.Close()
	commits := pgoutbox.NewCommitWatch()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: url, ApplicationName: "tenant-service", Configure: commits.Watch})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	tbl, err := ferrytest.OutboxTable()
	require.NoError(t, err)
	ob, err := pgoutbox.New(pgoutbox.Config{Table: tbl}, nil)
	require.NoError(t, err)
	waker := pgoutbox.NewWaker(pool, pgoutbox.WakerConfig{})
	ob.SetWaker(waker)
	commits.OnCommit(waker.Committed)
	wctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = waker.Run(wctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return &tenantDB{id: id, url: url, pool: pool, outbox: ob}
}

// place publishes an order as the README does: the business write and
// the event in one transaction.
func (d *tenantDB) place(ctx context.Context, n int) error {
	id := fmt.Sprintf("%s-%d", d.id, n)
	err := pgx.BeginFunc(pipeline.ContextWithTenantID(ctx, d.id), d.pool, func(tx pgx.Tx) error {
		return d.outbox.Publish(ctx, tx, "tenants.order_placed", id, order{ID: id})
	})
	if err == nil {
		d.placed = append(d.placed, id)
	}
	return err
}

func (d *tenantDB) effects(t *testing.T, ctx context.Context) map[string]int {
	t.Helper()
	rows, err := d.pool.Query(ctx, `SELECT order_id, tenant FROM effects`)
	require.NoError(t, err)
	got := map[string]int{}
	for rows.Next() {
		var id, tenant string
		require.NoError(t, rows.Scan(&id, &tenant))
		require.Equal(t, d.id, tenant, "an effect in %s's database ran for tenant %s", d.id, tenant)
		require.True(t, strings.HasPrefix(id, d.id+"-"), "order %s crossed into %s's database", id, d.id)
		got[id]++
	}
	require.NoError(t, rows.Err())
	return got
}

// Three tenant databases on two PostgreSQL servers, served by two fleet
// processes: every order's effect runs once, in its own tenant's
// database; a tenant added while the load runs is served, one removed is
// served no more (its events at the broker go to the poison store with the
// reason, its outbox keeps the rest); a server killed stops its tenants
// only.
func TestAFleetServesTenantsOnTwoServersAndNothingCrosses(t *testing.T) {
	ctx := context.Background()
	serverA, serverB := pipelinetest.OwnPostgres(t), pipelinetest.OwnPostgres(t)
	for _, db := range []string{"shop_a", "shop_b", "shop_d"} {
		require.NoError(t, serverA.Exec(ctx, "postgres", "CREATE DATABASE "+db))
	}
	require.NoError(t, serverB.Exec(ctx, "postgres", "CREATE DATABASE shop_c"))
	shops := map[string]*tenantDB{
		"acme":   openTenant(t, ctx, "acme", serverA.URL("shop_a")),
		"bolt":   openTenant(t, ctx, "bolt", serverA.URL("shop_b")),
		"crux":   openTenant(t, ctx, "crux", serverB.URL("shop_c")),
		"dynamo": openTenant(t, ctx, "dynamo", serverA.URL("shop_d")),
	}

	control, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	fleet := func(c *app.Config) {
		c.Tenants = true
		c.Fleet.Reload = 200 * time.Millisecond
		c.Fleet.Sweep = 2 * time.Second
	}
	a1, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: effectRoute}, fleet)
	a2, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: effectRoute}, fleet)
	for _, id := range []string{"acme", "bolt", "crux"} {
		require.NoError(t, pgtenants.Add(ctx, a1.Pool(), pgtenants.Tenant{ID: id, DatabaseURL: shops[id].url}, "test"))
	}

	var placing sync.WaitGroup
	var failed atomic.Value
	load := func(d *tenantDB, from, to int) {
		placing.Go(func() {
			for n := from; n < to; n++ {
				if err := d.place(ctx, n); err != nil {
					failed.Store(fmt.Errorf("placing %s's order %d: %w", d.id, n, err))
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	wait := func() {
		placing.Wait()
		if err, _ := failed.Load().(error); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"acme", "bolt", "crux"} {
		load(shops[id], 0, 200)
	}
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, pgtenants.Add(ctx, a1.Pool(), pgtenants.Tenant{ID: "dynamo", DatabaseURL: shops["dynamo"].url}, "test"))
	load(shops["dynamo"], 0, 150)
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, pgtenants.Remove(ctx, a1.Pool(), "bolt", "test"))
	wait()

	// Every order of the tenants still registered has its effect, once.
	for _, id := range []string{"acme", "crux", "dynamo"} {
		d := shops[id]
		require.Eventually(t, func() bool { return len(d.effects(t, ctx)) == len(d.placed) }, time.Minute, 50*time.Millisecond,
			"every order of %s has its effect", id)
		for order, n := range d.effects(t, ctx) {
			require.Equal(t, 1, n, "order %s ran %d times", order, n)
		}
	}

	// The removed tenant: an order has one effect at most; what was at
	// the broker when it went reached the poison store, with the reason;
	// the rest waits in its outbox.
	time.Sleep(2 * time.Second) // the removal's reload, and what was at the broker
	bolt := shops["bolt"]
	done := bolt.effects(t, ctx)
	for order, n := range done {
		require.Equal(t, 1, n, "order %s ran %d times", order, n)
	}
	require.Less(t, len(done), len(bolt.placed), "bolt's orders placed after its removal are not relayed")
	poisoned := pipelinetest.Poisoned(t, a1.Pool(), pgpoison.Filter{})
	require.Len(t, pipelinetest.Poisoned(t, a1.Pool(), pgpoison.Filter{Tenant: "bolt"}), len(poisoned), "the poison store filters by tenant")
	require.Empty(t, pipelinetest.Poisoned(t, a1.Pool(), pgpoison.Filter{Tenant: "acme"}))
	for _, p := range poisoned {
		require.Contains(t, p.Reason, "not in the registry", "only the removed tenant's events are poisoned, for that reason")
		require.Equal(t, "bolt", p.Headers[pipeline.MetaTenantID])
		require.Zero(t, done[p.AggregateID], "a poisoned order has no effect")
	}
	t.Logf("bolt after its removal: %d effects and %d poisoned of %d orders", len(done), len(poisoned), len(bolt.placed))

	// A server killed: the other server's tenants go on, and an event of
	// a tenant of the dead server (one that reached the broker through
	// the control database's outbox, as a requeue from the poison store
	// does) waits in the control database's outbox, deferred with no
	// attempt spent, instead of holding a consumer every tenant shares.
	require.NoError(t, serverB.Halt())
	stranded, err := pipeline.NewEvent(pipeline.ContextWithTenantID(ctx, "crux"), "crux-9999", order{ID: "crux-9999"})
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, a1.Pool(), func(tx pgx.Tx) error {
		return a1.Outbox().PublishTx(ctx, pgoutbox.PgxTx(tx), "tenants.order_placed", stranded)
	}))
	for _, id := range []string{"acme", "dynamo"} {
		load(shops[id], 1000, 1050)
	}
	wait()
	for _, id := range []string{"acme", "dynamo"} {
		d := shops[id]
		require.Eventually(t, func() bool { return len(d.effects(t, ctx)) == len(d.placed) }, 30*time.Second, 50*time.Millisecond,
			"%s's orders go on while the other server is down", id)
	}
	require.Eventually(t, func() bool {
		rows, err := a1.OutboxTable().Rows(ctx, a1.Pool(), pgoutbox.RowFilter{MessageID: stranded.UUID})
		require.NoError(t, err)
		for _, r := range rows {
			if r.Topic == pipeline.RetryTopic && r.Headers[pipeline.MetaTenantID] == "crux" {
				require.Equal(t, "1", r.Headers[pipeline.MetaAttempt], "a deferral spends no attempt")
				return true
			}
		}
		return false
	}, 15*time.Second, 50*time.Millisecond, "the dead server's tenant's event is deferred into the control database's outbox")
	require.Zero(t, pipelinetest.CountPoisoned(t, a1.Pool(), pgpoison.Filter{MessageID: stranded.UUID}), "an outage is not the event's fault")

	// The member that serves the dead server's tenant says so in its
	// metrics (FerryTenantRelayFailing pages on it); acme is not failing.
	failing := func(tenant string) float64 {
		var most float64
		for _, a := range []*app.App{a1, a2} {
			require.NoError(t, a.Metrics().Refresh(ctx, a.Pool()))
			families, err := a.Metrics().Registry.Gather()
			require.NoError(t, err)
			for _, f := range families {
				if f.GetName() != "ferry_tenant_relay_failing" {
					continue
				}
				for _, m := range f.GetMetric() {
					if m.GetLabel()[0].GetValue() == tenant {
						most = max(most, m.GetGauge().GetValue())
					}
				}
			}
		}
		return most
	}
	require.Eventually(t, func() bool { return failing("crux") == 1 }, 15*time.Second, 100*time.Millisecond, "crux's relay is reported failing")
	require.Zero(t, failing("acme"))
}

// A tenant with a backlog does not hold another tenant's new event behind
// it: the fleet sends the backlog a batch at a time, each when the route's
// queue has room, and the quiet tenant's event goes at once, so that it is
// handled while most of the backlog still waits in its outbox, not after
// it. (With FERRY_TENANTS_BACKLOG_ROOM off the relay pushes the backlog to
// the broker far faster than the consumers take it, and the quiet event
// waits behind it there: 3,600 of its events were handled first, 5.5 s;
// with it, 300 and 0.3 s.)
func TestATenantsBacklogDoesNotHoldAnothersNewEvent(t *testing.T) {
	ctx := context.Background()
	control, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	noisySchema, quietSchema := ferrytest.Schema(t, effects), ferrytest.Schema(t, effects)
	a, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: effectRoute}, func(c *app.Config) {
		c.Tenants = true
		c.Fleet.Reload = 200 * time.Millisecond
		// The room and the lanes alone (the pace that spaces backlogs
		// out beside slower new events has a test of its own), so that
		// the backlog drains at the consumers' speed.
		c.Fleet.BacklogSlowdown = -1
	})
	noisy, quiet := ferrytest.Pool(t, noisySchema, "tenant-service"), ferrytest.Pool(t, quietSchema, "tenant-service")
	const backlog = 20_000
	tbl, err := ferrytest.OutboxTable()
	require.NoError(t, err)
	_, err = noisy.Exec(ctx, `INSERT INTO `+tbl.Quoted()+` (message_uuid, aggregate_id, topic, payload, headers, part)
		SELECT gen_random_uuid()::text, 'noisy-' || g, 'tenants.order_placed', jsonb_build_object('id', 'noisy-' || g), '{}', ferry_outbox_part(now())
		FROM generate_series(1, $1) g`, backlog)
	require.NoError(t, err)
	count := func(pool *pgxpool.Pool) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&n))
		return n
	}
	require.NoError(t, pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: "noisy", Schema: noisySchema}, "test"))
	require.NoError(t, pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: "quiet", Schema: quietSchema}, "test"))
	require.Eventually(t, func() bool { return count(noisy) > 500 }, 30*time.Second, 20*time.Millisecond, "the backlog drains")

	ob, err := pgoutbox.New(pgoutbox.Config{Table: tbl}, nil)
	require.NoError(t, err)
	placed, handledBefore := time.Now(), count(noisy)
	require.NoError(t, pgx.BeginFunc(ctx, quiet, func(tx pgx.Tx) error {
		if err := ob.Publish(ctx, tx, "tenants.order_placed", "quiet-1", order{ID: "quiet-1"}); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, pgoutbox.NotifyChannel, quietSchema)
		return err
	}))
	require.Eventually(t, func() bool { return count(quiet) == 1 }, time.Minute, 5*time.Millisecond, "the quiet tenant's event is handled")
	waited, ahead := time.Since(placed), count(noisy)-handledBefore
	t.Logf("the quiet tenant's event took %s; %d of the noisy tenant's events were handled between its commit and its effect", waited.Round(time.Millisecond), ahead)
	// What may be ahead of it: the queue's room (100), the consumers'
	// prefetch (16 each) and a batch in flight (100).
	require.Less(t, ahead, 1000, "the quiet tenant's event waited behind the backlog at the broker")
	require.Eventually(t, func() bool { return count(noisy) == backlog }, 2*time.Minute, 100*time.Millisecond, "the backlog drains whole")
}

// The tenants' connections stay within the budget however many tenant
// databases have work: a connection past it closes the idle ones of the
// database used least recently, and every tenant's events are still
// handled. (Tenants in schemas of one database share its pool; the budget
// is for tenants spread over databases.)
func TestTheTenantsConnectionsStayWithinTheBudget(t *testing.T) {
	ctx := context.Background()
	server := pipelinetest.OwnPostgres(t)
	control, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	const tenants, budget = 5, 3
	a, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: effectRoute}, func(c *app.Config) {
		c.Tenants = true
		c.Fleet.Reload = 200 * time.Millisecond
		c.Fleet.Pools.Budget, c.Fleet.Pools.MaxConns = budget, 2
	})
	shops := make([]*tenantDB, tenants)
	for i := range shops {
		db := fmt.Sprintf("shop_%d", i)
		require.NoError(t, server.Exec(ctx, "postgres", "CREATE DATABASE "+db))
		shops[i] = openTenant(t, ctx, fmt.Sprintf("t%d", i), server.URL(db))
		require.NoError(t, pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: shops[i].id, DatabaseURL: shops[i].url}, "test"))
	}
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: server.URL("postgres"), ApplicationName: "ferry-test-admin"})
	require.NoError(t, err)
	defer admin.Close()
	var most atomic.Int64
	sampling, stop := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampling.Err() == nil {
			var n int64
			if err := admin.QueryRow(sampling, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ferry-tenants'`).Scan(&n); err == nil && n > most.Load() {
				most.Store(n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for round := range 3 {
		for _, d := range shops {
			require.NoError(t, d.place(ctx, round))
		}
	}
	for _, d := range shops {
		require.Eventually(t, func() bool { return len(d.effects(t, ctx)) == 3 }, time.Minute, 20*time.Millisecond, "tenant %s's events are handled", d.id)
	}
	stop()
	<-sampled
	t.Logf("at most %d connections to the tenants' databases (budget %d, %d tenant databases)", most.Load(), budget, tenants)
	require.LessOrEqual(t, most.Load(), int64(budget))
	require.Positive(t, most.Load())
}

// A connection of a tenant database's pool is given only to a use that
// names its tenant, and with that tenant's schema: one asked for without
// a tenant is refused, never served in the schema the connection had.
func TestATenantPoolServesOnlyUsesThatNameTheirTenant(t *testing.T) {
	ctx := context.Background()
	a, b := ferrytest.Schema(t, effects), ferrytest.Schema(t, effects)
	pools, err := tenancy.NewPools(tenancy.PoolsConfig{ControlURL: pipelinetest.DatabaseURL(), MaxConns: 1})
	require.NoError(t, err)
	defer pools.Close()
	ta, tb := pgtenants.Tenant{ID: "a", Schema: a}, pgtenants.Tenant{ID: "b", Schema: b}
	pool, err := pools.Pool(ctx, ta)
	require.NoError(t, err)
	poolB, err := pools.Pool(ctx, tb)
	require.NoError(t, err)
	require.Same(t, pool, poolB, "one pool for the database's schemas")
	for i, tn := range []pgtenants.Tenant{ta, tb, ta, tb} {
		_, err := pool.Exec(tenancy.For(ctx, tn), `INSERT INTO effects (order_id, tenant) VALUES ($1, $2)`, fmt.Sprint(i), tn.ID)
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `INSERT INTO effects (order_id, tenant) VALUES ('stray', 'none')`)
	require.ErrorContains(t, err, "without its tenant")
	for _, tn := range []pgtenants.Tenant{ta, tb} {
		var n int
		require.NoError(t, pool.QueryRow(tenancy.For(ctx, tn), `SELECT count(*) FROM effects WHERE tenant = $1`, tn.ID).Scan(&n))
		require.Equal(t, 2, n, "tenant %s's rows are in its own schema", tn.ID)
		require.NoError(t, pool.QueryRow(tenancy.For(ctx, tn), `SELECT count(*) FROM effects`).Scan(&n))
		require.Equal(t, 2, n, "and only its own")
	}
}

// A batch route in a fleet: a batch is one tenant's messages, in one
// transaction on that tenant's database, so every order's effect lands
// once in its own tenant's database, whichever tenants' events arrived
// together.
func TestABatchRouteInAFleetBatchesEachTenantOnItsDatabase(t *testing.T) {
	ctx := context.Background()
	server := pipelinetest.OwnPostgres(t)
	control, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	var mu sync.Mutex
	var sizes []int
	batchRoute := func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "tenants.effects", Topic: "tenants.order_placed", Batch: &handlers.Batch{MaxSize: 50, MaxWait: 100 * time.Millisecond,
			Handler: func(ctx context.Context, msgs []*message.Message) error {
				tenant := pipeline.TenantIDFromContext(ctx)
				tx := pgledger.TxFromContext(ctx)
				for _, m := range msgs {
					if got := pipeline.TenantIDFromContext(m.Context()); got != tenant {
						return fmt.Errorf("a batch of tenant %s holds a message of tenant %s", tenant, got)
					}
					var o order
					if err := json.Unmarshal(m.Payload, &o); err != nil {
						return pipeline.Permanent(err)
					}
					if _, err := tx.Exec(ctx, `INSERT INTO effects (order_id, tenant) VALUES ($1, $2)`, o.ID, tenant); err != nil {
						return err
					}
				}
				mu.Lock()
				sizes = append(sizes, len(msgs))
				mu.Unlock()
				return nil
			}}}}, nil
	}
	a, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: batchRoute}, func(c *app.Config) {
		c.Tenants = true
		c.Fleet.Reload = 200 * time.Millisecond
		c.Fleet.BacklogSlowdown = -1 // the backlog at the consumers' speed
	})
	shops := make([]*tenantDB, 3)
	for i := range shops {
		db := fmt.Sprintf("shop_%d", i)
		require.NoError(t, server.Exec(ctx, "postgres", "CREATE DATABASE "+db))
		shops[i] = openTenant(t, ctx, fmt.Sprintf("t%d", i), server.URL(db))
		require.NoError(t, pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: shops[i].id, DatabaseURL: shops[i].url}, "test"))
	}
	// t0 has a backlog: the relay's batches of it come back full, and
	// the next go to the route's backlog lane, which a batch route
	// consumes too.
	const orders, backlog = 60, 600
	tbl, err := ferrytest.OutboxTable()
	require.NoError(t, err)
	_, err = shops[0].pool.Exec(ctx, `INSERT INTO `+tbl.Quoted()+` (message_uuid, aggregate_id, topic, payload, headers, part)
		SELECT gen_random_uuid()::text, 't0-b' || g, 'tenants.order_placed', jsonb_build_object('id', 't0-b' || g), '{}', ferry_outbox_part(now())
		FROM generate_series(1, $1) g`, backlog)
	require.NoError(t, err)
	for n := range orders {
		for _, d := range shops {
			require.NoError(t, d.place(ctx, n))
		}
	}
	for i, d := range shops {
		want := orders
		if i == 0 {
			want += backlog
		}
		require.Eventually(t, func() bool { return len(d.effects(t, ctx)) == want }, 2*time.Minute, 50*time.Millisecond, "tenant %s's events are handled", d.id)
		for id, n := range d.effects(t, ctx) {
			require.Equal(t, 1, n, "order %s's effect once", id)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	require.Greater(t, slices.Max(sizes), 1, "the messages were batched: %v", sizes)
}
