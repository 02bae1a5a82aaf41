package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// On the real ledger: deliveries that arrive together are handled in
// batches of more than one, each message's effect once; a message the
// ledger already holds is skipped, not handed to the batch again; when a
// batch fails, its messages are retried one by one, so only the bad one
// fails and the others are done.
func TestBatcherHandlesTogetherOnceEachAndIsolatesTheBadOne(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	guard, err := middleware.NewIdempotency(ledger, nil)
	require.NoError(t, err)
	var mu sync.Mutex
	effects := map[string]int{}
	var sizes []int
	b, err := middleware.NewBatcher(guard, ledger, func(ctx context.Context, msgs []*message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		sizes = append(sizes, len(msgs))
		for _, m := range msgs {
			if m.UUID == "bad" {
				return pipeline.Permanent(errors.New("unparseable order"))
			}
		}
		for _, m := range msgs {
			effects[m.UUID]++
		}
		return nil
	}, middleware.BatchConfig{MaxSize: 10, MaxWait: 50 * time.Millisecond})
	require.NoError(t, err)
	ctx := handlerContext(t, "projection.orders")

	run := func(ids ...string) map[string]error {
		var wg sync.WaitGroup
		var rmu sync.Mutex
		out := map[string]error{}
		for _, id := range ids {
			wg.Go(func() {
				m := message.NewMessage(id, []byte(`{"id":"`+id+`"}`))
				m.SetContext(ctx)
				_, err := b.Handler(m)
				rmu.Lock()
				out[id] = err
				rmu.Unlock()
			})
		}
		wg.Wait()
		return out
	}
	var first []string
	for i := range 8 {
		first = append(first, fmt.Sprint("o-", i))
	}
	for id, err := range run(first...) {
		require.NoError(t, err, id)
	}
	mu.Lock()
	require.Less(t, len(sizes), 8, "arriving together, they were handled in batches: %v", sizes)
	mu.Unlock()

	// o-0 again (a redelivery), new ones, and a bad one in the same batch.
	res := run("o-0", "o-8", "o-9", "bad")
	require.NoError(t, res["o-0"])
	require.NoError(t, res["o-8"])
	require.NoError(t, res["o-9"])
	require.True(t, pipeline.IsPermanent(res["bad"]), "%v", res["bad"])
	mu.Lock()
	defer mu.Unlock()
	for i := range 10 {
		require.Equal(t, 1, effects[fmt.Sprint("o-", i)], "o-%d's effect once", i)
	}
	require.Zero(t, effects["bad"])
	processed, err := ledger.Processed(context.Background(), "projection.orders", "o-8")
	require.NoError(t, err)
	require.True(t, processed)
	processed, err = ledger.Processed(context.Background(), "projection.orders", "bad")
	require.NoError(t, err)
	require.False(t, processed, "the bad one is not recorded as done")
}
