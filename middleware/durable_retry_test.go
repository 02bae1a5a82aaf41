package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
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
		rows, err := pipelinetest.OutboxTable(t).Rows(ctx, pool, pgoutbox.RowFilter{Topic: pipeline.RetryTopic})
		require.NoError(t, err)
		if n = len(rows); n > 0 {
			newest := rows[n-1]
			attempt, queue, id = newest.Headers[pipeline.MetaAttempt], newest.Headers[pipeline.MetaRetryQueue], newest.Headers[pipeline.MetaMessageID]
			due = time.Until(newest.AvailableAt)
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

// A failing head of an ordered partition whose consumer stops mid-hold (a
// deploy) keeps its attempts: the next delivery goes on from the attempt
// the hold had reached (recorded in ferry_held_partitions) instead of
// starting over, so consumers restarted more often than MaxAttempts still
// poison a broken head, and its provider is not called forever.
func TestAHeldHeadKeepsItsAttemptsAcrossAConsumerStop(t *testing.T) {
	t.Parallel()
	pool, mw := heldRig(t, 3)
	const partition = "billing.charge" + pipeline.PartitionSeparator + "3"
	calls := 0
	// First delivery: attempt 1 fails, then the consumer stops during attempt 2.
	errs := deliver(t, partition, []message.HandlerMiddleware{mw}, func(*message.Message) ([]*message.Message, error) {
		calls++
		if calls == 1 {
			return nil, errors.New("provider 503")
		}
		return nil, context.Canceled
	}, message.NewMessage("order-9-charge", []byte(`{"order":9}`)))
	require.ErrorIs(t, errs[0], context.Canceled)
	held, err := pgheld.List(context.Background(), pool)
	require.NoError(t, err)
	require.Len(t, held, 1, "a stop keeps the hold for the next consumer")
	require.Equal(t, 2, held[0].Attempt)

	// Delivered again: attempts 2 and 3, then it gives up; not 1, 2 and 3.
	calls = 0
	errs = deliver(t, partition, []message.HandlerMiddleware{mw}, func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, errors.New("provider 503")
	}, message.NewMessage("order-9-charge", []byte(`{"order":9}`)))
	require.ErrorContains(t, errs[0], "gave up after 3 attempts")
	require.Equal(t, 2, calls, "the attempts went on from where the stop left them")
	held, err = pgheld.List(context.Background(), pool)
	require.NoError(t, err)
	require.Empty(t, held, "an outcome ends the hold")

	// Another message on the partition starts at its own first attempt,
	// and its success releases the hold.
	errs = deliver(t, partition, []message.HandlerMiddleware{mw}, func(*message.Message) ([]*message.Message, error) { return nil, nil },
		message.NewMessage("order-10-charge", []byte(`{"order":10}`)))
	require.NoError(t, errs[0])
}

// A consumer that takes over a held head after a restart waits out the
// backoff the hold was in before trying it again: it spent an attempt at
// once (and called the provider) on every restart.
func TestAHeldHeadKeepsItsBackoffAcrossAConsumerStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, mw := heldRig(t, 5)
	const partition = "billing.charge" + pipeline.PartitionSeparator + "4"
	calls := 0
	// Attempt 1 fails; the consumer stops at attempt 2.
	errs := deliver(t, partition, []message.HandlerMiddleware{mw}, func(*message.Message) ([]*message.Message, error) {
		if calls++; calls == 1 {
			return nil, errors.New("provider 503")
		}
		return nil, context.Canceled
	}, message.NewMessage("order-11-charge", []byte(`{"order":11}`)))
	require.ErrorIs(t, errs[0], context.Canceled)
	// As if it had stopped in a long backoff: the next try is 1.5 s away.
	const left = 1500 * time.Millisecond
	_, err := pool.Exec(ctx, `UPDATE `+pgheld.Table+` SET retry_at = now() + $1 * interval '1 millisecond'`, left.Milliseconds())
	require.NoError(t, err)
	redelivered := time.Now()
	var tried time.Time
	errs = deliver(t, partition, []message.HandlerMiddleware{mw}, func(*message.Message) ([]*message.Message, error) {
		tried = time.Now()
		return nil, nil
	}, message.NewMessage("order-11-charge", []byte(`{"order":11}`)))
	require.NoError(t, errs[0])
	require.GreaterOrEqual(t, tried.Sub(redelivered), left-200*time.Millisecond, "the rest of the backoff was waited out, no attempt spent at once")
}

// heldRig is the durable retry link over a test schema with its holds
// recorded in pgheld, maxAttempts attempts and backoffs of milliseconds.
func heldRig(t *testing.T, maxAttempts int) (*pgxpool.Pool, message.HandlerMiddleware) {
	t.Helper()
	pool := pipelinetest.Postgres(t)
	resched, err := pgoutbox.NewRescheduler(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	mw, err := middleware.DurableRetryConfig{Scheduler: resched, MaxAttempts: maxAttempts, Holds: pgheld.Store{Pool: pool},
		Backoff: pipeline.Backoff{Initial: 5 * time.Millisecond, Max: 10 * time.Millisecond, Jitter: -1}}.Middleware(nil)
	require.NoError(t, err)
	return pool, mw
}
