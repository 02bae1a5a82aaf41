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

// A batch closes MaxGap after its last message when no other joins: a
// message arriving alone at a steady low rate is handled at once, not
// after MaxWait; messages arriving together still share a batch. With the
// gap off, the lone message waits MaxWait.
func TestABatchDoesNotWaitForMessagesThatAreNotComing(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	guard, err := middleware.NewIdempotency(ledger, nil)
	require.NoError(t, err)
	ctx := handlerContext(t, "projection.gap")
	batcher := func(gap time.Duration) (*middleware.Batcher, *[]int) {
		var mu sync.Mutex
		var sizes []int
		b, err := middleware.NewBatcher(guard, ledger, func(ctx context.Context, msgs []*message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			sizes = append(sizes, len(msgs))
			return nil
		}, middleware.BatchConfig{MaxSize: 100, MaxWait: time.Second, MaxGap: gap})
		require.NoError(t, err)
		return b, &sizes
	}
	handle := func(b *middleware.Batcher, id string) time.Duration {
		m := message.NewMessage(id, []byte(`{}`))
		m.SetContext(ctx)
		start := time.Now()
		_, err := b.Handler(m)
		require.NoError(t, err)
		return time.Since(start)
	}

	b, sizes := batcher(20 * time.Millisecond)
	took := handle(b, "lone-1")
	require.Less(t, took, 500*time.Millisecond, "a lone message waits the gap, not MaxWait (1 s)")
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() { handle(b, fmt.Sprint("together-", i)) })
	}
	wg.Wait()
	require.Less(t, len(*sizes), 1+20, "arriving together, they shared batches: %v", *sizes)

	off, _ := batcher(-1)
	took = handle(off, "lone-2")
	require.GreaterOrEqual(t, took, time.Second, "with the gap off, a lone message waits MaxWait")
}

// In a tenant fleet, a batch is one tenant's: messages of two tenants that
// arrive together are handled in batches of one tenant each, under that
// tenant's context (the ledger's transaction is on its database).
func TestABatchHoldsOneTenantsMessages(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	guard, err := middleware.NewIdempotency(ledger, nil)
	require.NoError(t, err)
	var mu sync.Mutex
	var batches [][]string
	b, err := middleware.NewBatcher(guard, ledger, func(ctx context.Context, msgs []*message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		tenant := pipeline.TenantIDFromContext(ctx)
		var ts []string
		for _, m := range msgs {
			ts = append(ts, pipeline.TenantIDFromContext(m.Context()))
		}
		batches = append(batches, append([]string{tenant}, ts...))
		return nil
	}, middleware.BatchConfig{MaxSize: 50, MaxWait: 200 * time.Millisecond})
	require.NoError(t, err)
	ctx := handlerContext(t, "projection.tenants")
	var wg sync.WaitGroup
	for i := range 20 {
		tenant := []string{"acme", "globex"}[i%2]
		wg.Go(func() {
			m := message.NewMessage(fmt.Sprint(tenant, "-", i), []byte(`{}`))
			m.SetContext(pipeline.ContextWithTenantID(ctx, tenant))
			_, err := b.Handler(m)
			require.NoError(t, err)
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	require.Less(t, len(batches), 20, "arriving together, they were batched: %v", batches)
	handled := 0
	for _, bt := range batches {
		for _, tenant := range bt[1:] {
			require.Equal(t, bt[0], tenant, "a batch under %s's context holds only its messages: %v", bt[0], bt)
		}
		handled += len(bt) - 1
	}
	require.Equal(t, 20, handled)
}
