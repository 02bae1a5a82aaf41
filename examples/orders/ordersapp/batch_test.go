package ordersapp_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// TestBatchRouteProjectsEachEventOnceAndPoisonsOnlyTheBadOne runs a batch
// route (a projection writing one row per event in the batch's
// transaction) over 600 events, one of which its handler always refuses.
// The batches that hold it fail as a whole; their other events go through
// alone, and only the bad one is retried and poisoned.
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
	_, err := h.app.Pool.Exec(ctx, `CREATE TABLE projected (message_id text PRIMARY KEY)`)
	require.NoError(t, err)

	var ids []string
	for chunk := 0; chunk < n; chunk += 100 {
		err := h.app.Outbox.InTx(ctx, h.app.Pool, func(ctx context.Context, _ pgoutbox.Querier, p *pgoutbox.Pending) error {
			var out []pipeline.Outgoing
			for i := chunk; i < chunk+100; i++ {
				v := i
				if i == 333 {
					v = -1
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
		require.NoError(t, h.app.Pool.QueryRow(ctx, q, args...).Scan(&c))
		return c
	}
	eventually(t, "599 events projected and the bad one poisoned", func() bool {
		return count(`SELECT count(*) FROM projected`) == n-1 && count(`SELECT count(*) FROM poison_messages`) == 1
	})
	var projected []string
	rows, err := h.app.Pool.Query(ctx, `SELECT message_id FROM projected`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		projected = append(projected, id)
	}
	require.NoError(t, rows.Err())
	require.ElementsMatch(t, ids, projected, "every good event projected, once")
	require.Equal(t, n-1, count(`SELECT count(*) FROM processed_messages WHERE consumer = $1`, route), "a ledger row per projected event, none for the bad one")

	poisoned, err := h.app.Poison.List(ctx, topic, 0)
	require.NoError(t, err)
	require.Len(t, poisoned, 1)
	require.Equal(t, route, pipeline.RouteName(poisoned[0].Consumer))
	require.Contains(t, poisoned[0].Reason, "a negative entry cannot be projected")
	require.JSONEq(t, `{"n":-1}`, string(poisoned[0].Payload))

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
