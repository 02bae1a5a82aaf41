//go:build !race

package ordersapp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// This file is left out of `go test -race`, as pipeline/rabbit's
// reconnect test is: watermill-amqp's ConnectionWrapper swaps its
// connection and its connected channel on reconnect without a lock
// (connection.go:96, :139 against :105, :114; Watermill issue #693, open),
// and every reconnect under load trips the race detector in Watermill's
// own subscriber, whatever Ferry does. CI runs it without -race (.ci/run).

// A RabbitMQ node dies under load: a 3-node cluster of the test's own,
// quorum queues (the default), FERRY_AMQP_URL listing the nodes. The node
// that leads most of the test's queues is stopped while orders are
// taken, relayed and handled, and brought back later. Every order has its
// effects exactly once, and the ordered route's effects of each account
// are in the order the account's orders were taken.
func TestBrokerNodeLossLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	nodes := pipelinetest.OwnRabbitCluster(t, 3)

	cfg, _, _ := testConfig(t)
	urls := make([]string, len(nodes))
	for i, n := range nodes {
		urls[i] = n.Config.URL
	}
	cfg.AMQP.URL = strings.Join(urls, ",")
	cfg.AMQP.Namespace = nodes[0].Config.Namespace
	cfg.AMQP.Partitions = 2
	pool := pipelinetest.Pool(t, cfg.DatabaseSchema, "ferry-test-broker-loss")
	_, err := pool.Exec(ctx, `CREATE TABLE ha_effects (id bigserial PRIMARY KEY, route text NOT NULL, account text NOT NULL, seq bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	effect := func(route string) handlers.Route {
		return handlers.Route{Name: route, Topic: "ha." + route, Ordered: route == "ledger", Handler: func(msg *message.Message) error {
			var o struct {
				Account string
				Seq     int64
			}
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return pipeline.Permanent(err)
			}
			_, err := pgledger.TxFromContext(msg.Context()).Exec(msg.Context(), `INSERT INTO ha_effects (route, account, seq) VALUES ($1, $2, $3)`, route, o.Account, o.Seq)
			return err
		}}
	}
	a, err := app.New(ctx, cfg, app.Options{Logger: slog.New(slog.DiscardHandler), Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{effect("mail"), effect("ledger")}, nil
	}})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- a.Run(runCtx, app.Components{Relay: true, Consumers: true}, nil) }()
	defer func() {
		stop()
		<-ran
		a.Close()
	}()

	// Orders for 10 accounts, an event per route each, about 200/s.
	var acked sync.Map // account/seq -> true
	var failures atomic.Int64
	seq := map[string]int64{}
	var mu sync.Mutex
	produce := func(until time.Time) {
		for i := 0; time.Now().Before(until); i++ {
			account := fmt.Sprintf("acct-%d", i%10)
			mu.Lock()
			seq[account]++
			s := seq[account]
			mu.Unlock()
			err := a.Outbox().InTx(ctx, a.Pool(), func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
				var events []pipeline.Outgoing
				for _, topic := range []string{"ha.mail", "ha.ledger"} {
					evt, err := pipeline.NewEvent(ctx, account, map[string]any{"account": account, "seq": s})
					if err != nil {
						return err
					}
					events = append(events, pipeline.Outgoing{Topic: topic, Msg: evt})
				}
				return p.PublishEvents(ctx, events...)
			})
			if err != nil {
				failures.Add(1) // the database is up: this should not happen
			} else {
				acked.Store(fmt.Sprintf("%s/%d", account, s), true)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	var wg sync.WaitGroup
	wg.Go(func() { produce(time.Now().Add(35 * time.Second)) })
	time.Sleep(4 * time.Second)

	leaders := func(asker *pipelinetest.RabbitNode) map[string]int {
		out := map[string]int{}
		for _, line := range strings.Split(asker.CtlOutput(t, "list_queues", "name", "leader", "--quiet", "--no-table-headers"), "\n") {
			f := strings.Fields(line)
			if len(f) == 2 && strings.HasPrefix(f[0], cfg.AMQP.Namespace) {
				out[f[1]]++
			}
		}
		require.NotEmpty(t, out, "the test's quorum queues have leaders")
		return out
	}
	leader := func(asker *pipelinetest.RabbitNode) (*pipelinetest.RabbitNode, int) {
		l := leaders(asker)
		top := nodes[0]
		for _, n := range nodes {
			if l[n.Name()] > l[top.Name()] {
				top = n
			}
		}
		return top, l[top.Name()]
	}
	// Ferry's connections go to the first node that answers: the first.
	// It is stopped (one node at a time: a quorum of three survives one
	// loss); once it is back, the node leading most of the test's queues
	// then is killed -9.
	connections := func(n *pipelinetest.RabbitNode) int {
		return strings.Count(n.CtlOutput(t, "list_connections", "name", "--quiet", "--no-table-headers"), "\n")
	}
	require.Positive(t, connections(nodes[0]), "Ferry's connections are on the first node")
	victim := nodes[0]
	led := leaders(nodes[1])[victim.Name()]
	victim.Ctl(t, "stop_app")
	time.Sleep(5 * time.Second)
	require.Positive(t, connections(nodes[1])+connections(nodes[2]), "Ferry's connections moved to a live node")
	victim.Ctl(t, "start_app")
	victim.Ctl(t, "await_startup")
	time.Sleep(3 * time.Second)
	asker := nodes[1]
	killed, killedLed := leader(asker)
	killed.Kill(t)
	time.Sleep(5 * time.Second)
	killed.Start(t)
	wg.Wait()

	count := 0
	acked.Range(func(any, any) bool { count++; return true })
	require.Zero(t, failures.Load(), "the database stayed up: every commit is taken")
	require.Greater(t, count, 1000)
	require.Eventually(t, func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM ha_effects`).Scan(&n) == nil && n >= 2*count
	}, 2*time.Minute, 250*time.Millisecond, "every order's two effects")
	time.Sleep(time.Second) // a late duplicate would show now
	rows, err := pool.Query(ctx, `SELECT route, account, seq FROM ha_effects ORDER BY id`)
	require.NoError(t, err)
	seen := map[string]int{}
	order := map[string][]int64{}
	for rows.Next() {
		var route, account string
		var s int64
		require.NoError(t, rows.Scan(&route, &account, &s))
		seen[fmt.Sprintf("%s %s/%d", route, account, s)]++
		if route == "ledger" {
			order[account] = append(order[account], s)
		}
	}
	require.NoError(t, rows.Err())
	var doubled, missing []string
	for k, n := range seen {
		if n > 1 {
			doubled = append(doubled, k)
		}
	}
	acked.Range(func(k, _ any) bool {
		for _, route := range []string{"mail", "ledger"} {
			if seen[route+" "+k.(string)] == 0 {
				missing = append(missing, route+" "+k.(string))
			}
		}
		return true
	})
	sort.Strings(doubled)
	require.Empty(t, missing, "lost effects")
	require.Empty(t, doubled, "effects done twice")
	for account, seqs := range order {
		require.True(t, sort.SliceIsSorted(seqs, func(i, j int) bool { return seqs[i] < seqs[j] }), "the ledger route's effects of %s are in order: %v", account, seqs)
	}
	require.Zero(t, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}))
	// The pauses: the longest time without a confirmed publish, and
	// without an effect, while orders kept coming.
	publishGap := longestPublishGap(t, pool)
	var effectGap float64
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(max(g), 0) FROM (SELECT extract(epoch FROM at - lag(at) OVER (ORDER BY at)) g FROM ha_effects) x`).Scan(&effectGap))
	t.Logf("longest pause: publishing %.2fs, effects %.2fs", publishGap, effectGap)
	t.Logf("broker node loss: %s (leading %d of the test's queues) (Ferry's connections' node) stopped for 5s, then %s (leading %d) killed -9 for 5s; %d orders, %d effects, each once, in order per account",
		victim.Name(), led, killed.Name(), killedLed, count, 2*count)
}

// longestPublishGap is the longest time, in seconds, between two marked
// publishes of the outbox's rows.
func longestPublishGap(t *testing.T, pool *pgxpool.Pool) float64 {
	t.Helper()
	rows, err := pgoutbox.Table{}.Rows(context.Background(), pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	var at []time.Time
	for _, r := range rows {
		if r.DispatchedAt != nil {
			at = append(at, *r.DispatchedAt)
		}
	}
	slices.SortFunc(at, time.Time.Compare)
	var gap time.Duration
	for i := 1; i < len(at); i++ {
		gap = max(gap, at[i].Sub(at[i-1]))
	}
	return gap.Seconds()
}
