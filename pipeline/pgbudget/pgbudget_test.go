package pgbudget_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgbudget"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// Concurrent spenders (other processes, in production) never exceed the limit together.
func TestSpendNeverExceedsTheLimit(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	s, err := pgbudget.New(pool)
	require.NoError(t, err)
	var granted atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 10 {
				ok, after, err := s.Spend(context.Background(), "llm", 3, 50, time.Hour)
				require.NoError(t, err)
				if ok {
					granted.Add(3)
				} else {
					require.Positive(t, after)
					require.LessOrEqual(t, after, time.Hour)
				}
			}
		})
	}
	wg.Wait()
	require.EqualValues(t, 48, granted.Load(), "16 spends of 3 fit in 50")
	used, err := s.Used(context.Background(), "llm", time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 48, used)

	_, _, err = s.Spend(context.Background(), "llm", 60, 50, time.Hour)
	require.Error(t, err, "a cost above the limit can never be spent")
	ok, _, err := s.Spend(context.Background(), "other", 50, 50, time.Hour)
	require.NoError(t, err)
	require.True(t, ok, "budgets are independent")
}
