package tenancy_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgparked"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// orderedEffectRoute is effectRoute on an ordered topic.
func orderedEffectRoute(app.Deps) ([]handlers.Route, error) {
	return []handlers.Route{{Name: "tenants.ordered", Topic: "tenants.order_step", Ordered: true, Handler: writeEffect}}, nil
}

// An ordered partition is every tenant's. While one tenant's database is
// out of reach, its events there are parked in the control database, in
// order, and the partition goes on with the other tenants' events; once
// the database is back they are handled first, in order, before the
// tenant's later events, each once. (Held instead, as a partition holds
// behind a failing head, acme's steps waited for crux's server to come
// back.)
func TestAnOrderedPartitionParksATenantOutOfReachAndGoesOn(t *testing.T) {
	ctx := context.Background()
	serverA, serverB := pipelinetest.OwnPostgres(t), pipelinetest.OwnPostgres(t)
	require.NoError(t, serverA.Exec(ctx, "postgres", "CREATE DATABASE shop_a"))
	require.NoError(t, serverB.Exec(ctx, "postgres", "CREATE DATABASE shop_c"))
	acme, crux := openTenant(t, ctx, "acme", serverA.URL("shop_a")), openTenant(t, ctx, "crux", serverB.URL("shop_c"))

	control, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	a, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: orderedEffectRoute}, func(c *app.Config) {
		c.Tenants = true
		c.Fleet.Reload = 200 * time.Millisecond
		c.AMQP.Partitions = 1 // the two tenants share the one partition
	})
	for _, d := range []*tenantDB{acme, crux} {
		require.NoError(t, pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: d.id, DatabaseURL: d.url}, "test"))
	}
	tbl, err := ferrytest.OutboxTable()
	require.NoError(t, err)
	ob, err := pgoutbox.New(pgoutbox.Config{Table: tbl}, nil)
	require.NoError(t, err)
	// step publishes one step of the tenant's one aggregate, as the
	// README does, in the database q.
	step := func(q interface {
		Begin(context.Context) (pgx.Tx, error)
	}, outbox *pgoutbox.Outbox, tenant string, n int) {
		t.Helper()
		id := fmt.Sprintf("%s-%04d", tenant, n)
		require.NoError(t, pgx.BeginFunc(ctx, q, func(tx pgx.Tx) error {
			return outbox.Publish(pipeline.ContextWithTenantID(ctx, tenant), tx, "tenants.order_step", tenant, order{ID: id})
		}))
	}
	steps := func(d *tenantDB) []string {
		rows, err := d.pool.Query(ctx, `SELECT order_id FROM effects ORDER BY at`)
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return ids
	}
	for n := range 5 {
		step(acme.pool, ob, "acme", n)
		step(crux.pool, ob, "crux", n)
	}
	require.Eventually(t, func() bool { return len(steps(acme)) == 5 && len(steps(crux)) == 5 }, 30*time.Second, 50*time.Millisecond)

	// crux's server goes; its next steps reach the broker through the
	// control database's outbox (as a requeue from the poison store does)
	// and meet the outage in the partition acme shares.
	require.NoError(t, serverB.Halt())
	for n := 5; n < 10; n++ {
		step(a.Pool(), a.Outbox(), "crux", n)
	}
	started := time.Now()
	for n := 5; n < 25; n++ {
		step(acme.pool, ob, "acme", n)
	}
	require.Eventually(t, func() bool { return len(steps(acme)) == 25 }, 20*time.Second, 50*time.Millisecond,
		"acme's steps go on while crux's server is down")
	t.Logf("acme's 20 steps handled %s after crux's server went", time.Since(started).Round(time.Millisecond))
	store := pgparked.Store{Pool: a.Pool()}
	require.Eventually(t, func() bool {
		groups, err := store.Groups(ctx, false)
		require.NoError(t, err)
		return len(groups) == 1 && groups[0].TenantID == "crux" && groups[0].Parked == 5
	}, 10*time.Second, 50*time.Millisecond, "crux's five steps are parked")
	// ferry find says where a parked event waits, and why.
	groups, err := store.Groups(ctx, false)
	require.NoError(t, err)
	var first string
	_, err = store.Send(ctx, groups[0], func(_ context.Context, events []pgparked.Event) error {
		first = events[0].MessageID
		return errors.New("looking only")
	})
	require.ErrorContains(t, err, "looking only")
	found, err := pgstatus.Find(ctx, a.Pool(), a.OutboxTable(), nil, first, 10)
	require.NoError(t, err)
	require.Len(t, found.Trails, 1)
	require.Contains(t, found.Trails[0].Now, `parked out of ordered partition tenants.ordered@0 while tenant "crux"'s database is out of reach`)
	statuses, err := a.TenantStatuses(ctx)
	require.NoError(t, err)
	for _, s := range statuses {
		require.Equal(t, map[string]int{"acme": 0, "crux": 5}[s.ID], s.Parked, "%s's status counts its parked events", s.ID)
	}

	// crux's server is back: its parked steps are handled first, in
	// order, then the ones it publishes now, each once.
	require.NoError(t, serverB.Restart(ctx))
	for n := 10; n < 15; n++ {
		require.Eventually(t, func() bool {
			return pgx.BeginFunc(ctx, crux.pool, func(tx pgx.Tx) error {
				return ob.Publish(pipeline.ContextWithTenantID(ctx, "crux"), tx, "tenants.order_step", "crux", order{ID: fmt.Sprintf("crux-%04d", n)})
			}) == nil
		}, 20*time.Second, 100*time.Millisecond, "crux's database takes writes again")
	}
	want := make([]string, 15)
	for n := range want {
		want[n] = fmt.Sprintf("crux-%04d", n)
	}
	require.Eventually(t, func() bool { return len(steps(crux)) >= 15 }, 30*time.Second, 50*time.Millisecond)
	time.Sleep(500 * time.Millisecond) // a step that would come twice
	require.Equal(t, want, steps(crux), "crux's steps ran once each, in order")
	require.Eventually(t, func() bool {
		groups, err := store.Groups(ctx, false)
		require.NoError(t, err)
		return len(groups) == 0
	}, 10*time.Second, 50*time.Millisecond, "nothing stays parked")
	require.Zero(t, pipelinetest.CountPoisoned(t, a.Pool(), pgpoison.Filter{}), "an outage is not the events' fault")
}

// A tenant session terminated under a handler (an administrator, a
// pooler's reset) while its database answers is not an outage: the
// delivery is tried again at once on a new connection, not deferred 10 s
// into the control database's outbox as if the tenant's database were out
// of reach.
func TestATerminatedTenantSessionIsNotAnOutage(t *testing.T) {
	ctx := context.Background()
	server := pipelinetest.OwnPostgres(t)
	require.NoError(t, server.Exec(ctx, "postgres", "CREATE DATABASE shop_a"))
	acme := openTenant(t, ctx, "acme", server.URL("shop_a"))
	entered, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	routes := func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "tenants.effect", Topic: "tenants.order_placed", Handler: func(msg *message.Message) error {
			var o order
			if json.Unmarshal(msg.Payload, &o) == nil && o.ID == "acme-1" {
				once.Do(func() { close(entered); <-proceed })
			}
			return writeEffect(msg)
		}}}, nil
	}
	control, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	a, _ := ferrytest.AppOn(t, control, rmq, app.Options{Routes: routes}, func(c *app.Config) {
		c.Tenants = true
		c.Fleet.Reload = 200 * time.Millisecond
	})
	require.NoError(t, pgtenants.Add(ctx, a.Pool(), pgtenants.Tenant{ID: "acme", DatabaseURL: acme.url}, "test"))
	require.NoError(t, acme.place(ctx, 0))
	require.Eventually(t, func() bool { return len(acme.effects(t, ctx)) == 1 }, 30*time.Second, 20*time.Millisecond)

	require.NoError(t, acme.place(ctx, 1))
	<-entered
	require.NoError(t, server.Exec(ctx, "shop_a", `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE '%-tenants' AND pid <> pg_backend_pid()`))
	terminated := time.Now()
	close(proceed)
	require.Eventually(t, func() bool { return len(acme.effects(t, ctx)) == 2 }, 5*time.Second, 20*time.Millisecond,
		"handled again at once (deferred, it would wait 10 s)")
	t.Logf("handled %s after its session was terminated", time.Since(terminated).Round(time.Millisecond))
	rows, err := a.OutboxTable().Rows(ctx, a.Pool(), pgoutbox.RowFilter{})
	require.NoError(t, err)
	require.Empty(t, rows, "nothing deferred into the control database's outbox")
}
