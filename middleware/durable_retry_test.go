package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// On the real outbox: a failed delivery is written back as a durable
// retry (the next attempt, its handler's queue, the message id kept, due
// after the backoff) and acked; the last attempt and a Permanent error pass
// through to the poison link; a deferral is rescheduled without spending
// an attempt.
func TestDurableRetryWritesTheNextAttemptIntoTheOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	resched, err := pgoutbox.NewRescheduler(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	mw, err := middleware.DurableRetryConfig{Scheduler: resched, MaxAttempts: 3,
		Backoff: pipeline.Backoff{Initial: time.Minute, Max: time.Hour, Jitter: -1}}.Middleware(nil)
	require.NoError(t, err)
	mws := []message.HandlerMiddleware{mw}
	fail := func(err error) message.HandlerFunc {
		return func(*message.Message) ([]*message.Message, error) { return nil, err }
	}
	retries := func() (n int, attempt, queue, id string, due time.Duration) {
		rows, err := pool.Query(ctx, `SELECT headers->>$2, headers->>$3, headers->>$4, extract(epoch FROM available_at - now())
			FROM outbox WHERE topic = $1 ORDER BY id DESC`, pipeline.RetryTopic, pipeline.MetaAttempt, pipeline.MetaRetryQueue, pipeline.MetaMessageID)
		require.NoError(t, err)
		defer rows.Close()
		for rows.Next() {
			var secs float64
			if n == 0 {
				require.NoError(t, rows.Scan(&attempt, &queue, &id, &secs))
				due = time.Duration(secs * float64(time.Second))
			}
			n++
		}
		return
	}

	msg := message.NewMessage("order-7-charge", []byte(`{"order":7}`))
	errs := deliver(t, "billing.charge@w1", mws, fail(errors.New("provider 503")), msg)
	require.NoError(t, errs[0], "scheduled durably, so acked")
	n, attempt, queue, id, due := retries()
	require.Equal(t, 1, n)
	require.Equal(t, "2", attempt)
	require.Equal(t, pipeline.ConsumerQueue("billing.charge@w1"), queue)
	require.Equal(t, "order-7-charge", id, "the retry keeps the message id the ledger keys by")
	require.InDelta(t, time.Minute.Seconds(), due.Seconds(), 5)

	// The third and last attempt goes to the poison link.
	last := message.NewMessage("order-8-charge", []byte(`{}`))
	last.Metadata.Set(pipeline.MetaAttempt, strconv.Itoa(3))
	errs = deliver(t, "billing.charge@w1", mws, fail(errors.New("provider 503")), last)
	require.Error(t, errs[0])
	n, _, _, _, _ = retries()
	require.Equal(t, 1, n, "no retry after the last attempt")

	errs = deliver(t, "billing.charge@w1", mws, fail(pipeline.Permanent(errors.New("card stolen"))), message.NewMessage("order-9-charge", []byte(`{}`)))
	require.True(t, pipeline.IsPermanent(errs[0]))
	n, _, _, _, _ = retries()
	require.Equal(t, 1, n, "a permanent failure is not retried")

	deferred := message.NewMessage("order-10-charge", []byte(`{}`))
	deferred.Metadata.Set(pipeline.MetaAttempt, "2")
	errs = deliver(t, "billing.charge@w1", mws, fail(pipeline.Defer(errors.New("budget spent"), 10*time.Minute)), deferred)
	require.NoError(t, errs[0])
	n, attempt, _, id, due = retries()
	require.Equal(t, 2, n)
	require.Equal(t, "order-10-charge", id)
	require.Equal(t, "2", attempt, "a deferral spends no attempt")
	require.InDelta(t, (10 * time.Minute).Seconds(), due.Seconds(), 5)
}
