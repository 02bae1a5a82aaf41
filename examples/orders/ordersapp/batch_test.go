package ordersapp_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// TestBatchRouteProjectsEachEventOnceAndPoisonsOnlyTheBadOne runs a batch
// route (a projection writing one row per event in the batch's
// transaction) over 600 events: its handler always refuses one and panics
// on another. The batches that hold them fail as a whole; their other
// events go through alone, and only the two bad ones are retried and
// poisoned, each with its reason.
func TestBatchRouteProjectsEachEventOnceAndPoisonsOnlyTheBadOne(t *testing.T) {
	t.Parallel()
	const n, route, topic = 600, "projection.totals", "ledger.entry_posted"
	var (
		mu      sync.Mutex
		sizes   []int
		refused int
	)
	routes := func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: route, Topic: topic, Batch: &handlers.Batch{MaxSize: 50,
			Handler: func(ctx context.Context, msgs []*message.Message) error {
				tx := pgledger.TxFromContext(ctx)
				for _, m := range msgs {
					if string(m.Payload) == `{"n":-2}` {
						panic("projection bug")
					}
					if string(m.Payload) == `{"n":-1}` {
						mu.Lock()
						refused++
						mu.Unlock()
						return errors.New("a negative entry cannot be projected")
					}
					if _, err := tx.Exec(ctx, `INSERT INTO projected (message_id) VALUES ($1)`, pipeline.MessageID(m)); err != nil {
						return err
					}
				}
				mu.Lock()
				sizes = append(sizes, len(msgs))
				mu.Unlock()
				return nil
			}}}}, nil
	}
	h := start(t, app.Options{Routes: routes}, app.Components{Relay: true, Consumers: true})
	ctx := context.Background()
	_, err := h.app.Pool().Exec(ctx, `CREATE TABLE projected (message_id text PRIMARY KEY)`)
	require.NoError(t, err)

	var ids []string
	for chunk := 0; chunk < n; chunk += 100 {
		err := h.app.Outbox().InTx(ctx, h.app.Pool(), func(ctx context.Context, _ pgoutbox.Querier, p *pgoutbox.Pending) error {
			var out []pipeline.Outgoing
			for i := chunk; i < chunk+100; i++ {
				v := i
				switch i {
				case 333:
					v = -1
				case 444:
					v = -2
				}
				evt, err := pipeline.NewEvent(ctx, fmt.Sprintf("acct-%d", i%7), map[string]int{"n": v})
				if err != nil {
					return err
				}
				if v >= 0 {
					ids = append(ids, pipeline.MessageID(evt))
				}
				out = append(out, pipeline.Outgoing{Topic: topic, Msg: evt})
			}
			return p.PublishEvents(ctx, out...)
		})
		require.NoError(t, err)
	}

	count := func(q string, args ...any) int {
		var c int
		require.NoError(t, h.app.Pool().QueryRow(ctx, q, args...).Scan(&c))
		return c
	}
	eventually(t, "598 events projected and the two bad ones poisoned", func() bool {
		return count(`SELECT count(*) FROM projected`) == n-2 && pipelinetest.CountPoisoned(t, h.app.Pool(), pgpoison.Filter{}) == 2
	})
	rows, err := h.app.Pool().Query(ctx, `SELECT message_id FROM projected`)
	require.NoError(t, err)
	projected, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.ElementsMatch(t, ids, projected, "every good event projected, once")
	handled, err := pgledger.HandledOf(ctx, h.app.Pool(), ids, []string{route})
	require.NoError(t, err)
	require.Len(t, handled, n-2, "a ledger row per projected event, none for the bad ones")

	poisoned, err := h.app.Poison().List(ctx, topic, 0)
	require.NoError(t, err)
	require.Len(t, poisoned, 2)
	reasons := map[string]string{}
	for _, p := range poisoned {
		require.Equal(t, route, pipeline.RouteName(p.Consumer))
		reasons[string(p.Payload)] = p.Reason
	}
	require.Contains(t, reasons[`{"n":-1}`], "a negative entry cannot be projected")
	require.Contains(t, reasons[`{"n":-2}`], "projection bug")

	// The batches are counted: committed ones, and the failed ones that
	// held a bad event.
	families, err := h.app.Metrics().Registry.Gather()
	require.NoError(t, err)
	batches := map[string]float64{}
	var observed uint64
	for _, f := range families {
		for _, m := range f.GetMetric() {
			switch f.GetName() {
			case "ferry_consumer_batches_total":
				batches[m.GetLabel()[1].GetValue()] += m.GetCounter().GetValue()
			case "ferry_consumer_batch_size":
				observed += m.GetHistogram().GetSampleCount()
			}
		}
	}
	require.GreaterOrEqual(t, batches["failed"], 2.0, "the bad events' batches failed: %v", batches)
	require.Positive(t, batches["committed"])
	require.EqualValues(t, batches["failed"]+batches["committed"], observed, "one size per batch")

	mu.Lock()
	defer mu.Unlock()
	require.Greater(t, slices.Max(sizes), 1, "events were handled in batches, not one by one")
	require.LessOrEqual(t, slices.Max(sizes), 50, "MaxSize bounds a batch")
	require.Less(t, len(sizes), n-1, "fewer batches than events")
	// The bad event's own attempts (quick retries and durable attempts,
	// each alone) refuse it as often as its batches did; it cost each batch
	// it joined one failed pass, and its neighbours no attempt.
	require.GreaterOrEqual(t, refused, 3)
}

// TestNewRefusesBatchRoutesThatCannotKeepTheirPromise: a batch keeps no
// order, so neither an ordered batch route nor a batch route on a topic
// ordered elsewhere starts; nor does a route with both kinds of handler,
// or a batching out of bounds. Every problem is named at once.
func TestNewRefusesBatchRoutesThatCannotKeepTheirPromise(t *testing.T) {
	t.Parallel()
	cfg, _, _ := testConfig(t)
	noop := func(context.Context, []*message.Message) error { return nil }
	build := func(routes ...handlers.Route) error {
		_, err := app.New(context.Background(), cfg, app.Options{Logger: slog.New(slog.DiscardHandler), Routes: func(app.Deps) ([]handlers.Route, error) { return routes, nil }})
		return err
	}
	err := build(
		handlers.Route{Name: "a", Topic: "t.a", Ordered: true, Batch: &handlers.Batch{Handler: noop}},
		handlers.Route{Name: "b", Topic: "t.b", Handler: func(*message.Message) error { return nil }, Batch: &handlers.Batch{Handler: noop}},
		handlers.Route{Name: "c", Topic: "t.c", Batch: &handlers.Batch{}},
	)
	require.ErrorContains(t, err, `route "a" is ordered and batched`)
	require.ErrorContains(t, err, `route "b" has both a Handler and a Batch`)
	require.ErrorContains(t, err, `route "c": its Batch has no Handler`)

	err = build(
		handlers.Route{Name: "ordered", Topic: "t.shared", Ordered: true, Handler: func(*message.Message) error { return nil }},
		handlers.Route{Name: "projection", Topic: "t.shared", Batch: &handlers.Batch{Handler: noop}},
		handlers.Route{Name: "huge", Topic: "t.d", Batch: &handlers.Batch{Handler: noop, MaxSize: 20_000, MaxWait: -time.Second}},
	)
	require.ErrorContains(t, err, `route "projection" is batched but its topic "t.shared" is ordered`)
	require.ErrorContains(t, err, `route "huge": batch MaxSize must be in [1, 10000], got 20000`)
	require.ErrorContains(t, err, "batch MaxWait must be in [0, 1s], got -1s")
}
