package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// errConnectionDown is what a publisher whose connection is down answers
// (rabbit.BatchPublisher marks it so).
var errConnectionDown = pipeline.Infrastructure(errors.New("rabbit: not connected to RabbitMQ (reconnecting)"))

// A relay that cannot reach the broker takes no row's attempt: its batch
// records nothing (ErrBrokerUnreachable), every row stays as it was, due
// at once, and a relay that can reach the broker sends them all in its
// next batch. Before, each row was failed and pushed out by the backoff:
// a healthy relay's orders then waited for the sick relay's backoff.
func TestARelayThatCannotReachTheBrokerLeavesTheRowsToOthers(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	seed(t, pool, "orders.placed", 40, 10)
	sick := newRelay(t, pool, &recorder{Publisher: b.pub, before: func(*message.Message) error { return errConnectionDown }},
		pgoutbox.RelayConfig{Backoff: pipeline.Backoff{Initial: time.Hour, Max: time.Hour, Jitter: -1}})
	for range 3 {
		_, err := sick.RelayBatch(context.Background())
		require.ErrorIs(t, err, pgoutbox.ErrBrokerUnreachable)
		require.ErrorIs(t, err, pgoutbox.ErrNothingConfirmed)
	}
	require.Zero(t, countWhere(t, pool, "attempts > 0 OR last_error IS NOT NULL OR available_at > now()"), "no row spent an attempt or a backoff")
	require.Equal(t, 40, countPending(t, pool, ""))

	healthy := &recorder{Publisher: b.pub}
	res, err := newRelay(t, pool, healthy, pgoutbox.RelayConfig{BatchSize: 100}).RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, 40, res.Dispatched, "the healthy relay sends every row at once")
	require.Zero(t, countPending(t, pool, ""))
}

// A connection lost in the middle of a batch: what the broker confirmed
// is recorded, the rows not sent because of the outage are left slow and
// due at once with no attempt spent, and the next batch sends them.
func TestABrokerOutageMidBatchCostsTheRowsNothing(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	seed(t, pool, "orders.placed", 20, 20)
	var sent atomic.Int32
	rec := &recorder{Publisher: b.pub, before: func(*message.Message) error {
		if sent.Add(1) > 8 {
			return errConnectionDown
		}
		return nil
	}}
	// The append-only lane sends 8 and leaves 12 slow; the slow lane, in
	// the same RelayBatch, reaches no broker either: the batch says so.
	res, err := newRelay(t, pool, rec, pgoutbox.RelayConfig{Backoff: pipeline.Backoff{Initial: time.Hour, Max: time.Hour, Jitter: -1}}).RelayBatch(context.Background())
	require.ErrorIs(t, err, pgoutbox.ErrBrokerUnreachable)
	require.Equal(t, 8, res.Dispatched)
	require.Zero(t, res.Failed)
	require.Equal(t, 12, countWhere(t, pool, "slow AND NOT "+pgoutbox.DispatchedOutbox), "left slow, for the slow lane of any relay")
	require.Zero(t, countWhere(t, pool, "attempts > 0 OR last_error IS NOT NULL OR available_at > now()"), "no row spent an attempt or a backoff")
	require.Equal(t, 12, countPending(t, pool, ""))

	res, err = newRelay(t, pool, &recorder{Publisher: b.pub}, pgoutbox.RelayConfig{}).RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, 12, res.Dispatched)
	require.Len(t, b.drain(t), 20)
}

// A relay left running without its broker neither spins nor fails rows:
// it waits between tries (growing, up to seconds), while a second relay
// with a broker relays every row as it commits.
func TestARelayWithoutItsBrokerWaitsWhileAnotherRelays(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	var tries atomic.Int32
	sick := newRelay(t, pool, &recorder{Publisher: b.pub, before: func(*message.Message) error { tries.Add(1); return errConnectionDown }},
		pgoutbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	healthy := &recorder{Publisher: b.pub}
	good, err := pgoutbox.NewRelay(pool, healthy, pgoutbox.RelayConfig{Table: testTable, PollInterval: 10 * time.Millisecond}, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = sick.Run(ctx) })
	wg.Go(func() { _ = good.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	for i := range 10 {
		seed(t, pool, "orders.placed", 5, 5)
		healthy.awaitPublished(t, 5*(i+1), 10*time.Second)
		time.Sleep(100 * time.Millisecond)
	}
	require.Zero(t, countWhere(t, pool, "attempts > 0"), "no row was failed by the relay without a broker")
	require.Less(t, tries.Load(), int32(60), "the relay without a broker waits between tries instead of spinning")
}

// blackHole is a broker behind a black hole: a batch is sent and no
// confirm ever comes; only the caller's context ends the wait.
type blackHole struct{ message.Publisher }

func (blackHole) PublishBatch(ctx context.Context, batch []pipeline.Outgoing) []error {
	<-ctx.Done()
	errs := make([]error, len(batch))
	for i := range errs {
		errs[i] = fmt.Errorf("waiting for confirm of message %s: %w", batch[i].Msg.UUID, ctx.Err())
	}
	return errs
}

// A batch whose confirms never come gives up after ConfirmTimeout as the
// relay's outage, not the rows': it records nothing and lets go of the
// position, so another relay sends the rows at once instead of waiting
// for the connection's heartbeat to give up.
func TestABatchWithoutConfirmsLetsGoOfThePosition(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	seed(t, pool, "orders.placed", 10, 10)
	stuck := newRelay(t, pool, blackHole{b.pub}, pgoutbox.RelayConfig{ConfirmTimeout: 300 * time.Millisecond})
	start := time.Now()
	_, err := stuck.RelayBatch(context.Background())
	require.ErrorIs(t, err, pgoutbox.ErrBrokerUnreachable)
	require.ErrorContains(t, err, "FERRY_RELAY_CONFIRM_TIMEOUT")
	require.Less(t, time.Since(start), 5*time.Second)
	require.Zero(t, countWhere(t, pool, "attempts > 0 OR slow"), "nothing recorded of the rows")

	res, err := newRelay(t, pool, &recorder{Publisher: b.pub}, pgoutbox.RelayConfig{}).RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, 10, res.Dispatched)
}

// deaf is a publisher whose publish never returns until released, whatever
// its context: a relay whose link went silent mid-batch, which cannot
// even roll back its transaction.
type deaf struct {
	message.Publisher
	entered, release chan struct{}
	once             *sync.Once
}

func (d deaf) Publish(string, ...*message.Message) error {
	d.once.Do(func() { close(d.entered) })
	<-d.release
	return errors.New("released")
}

// A relay that holds the position and then goes silent (its database link
// dead, so it cannot roll back) holds it no longer than ConfirmTimeout and
// 2 s: each batch's transaction carries that bound on its idle time, and
// the server ends the session, releasing the position for the others.
// Without it the position stayed with the silent relay until its
// connection died, which behind a black hole takes until TCP gives up.
func TestASilentRelayLetsGoOfThePositionWithinItsBound(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	seed(t, pool, "orders.placed", 10, 10)
	d := deaf{Publisher: b.pub, entered: make(chan struct{}), release: make(chan struct{}), once: &sync.Once{}}
	silent := newRelay(t, pool, d, pgoutbox.RelayConfig{ConfirmTimeout: 500 * time.Millisecond})
	var wg sync.WaitGroup
	wg.Go(func() { _, _ = silent.RelayBatch(context.Background()) })
	t.Cleanup(func() { close(d.release); wg.Wait() })
	select {
	case <-d.entered: // it holds the position, publishing
	case <-time.After(10 * time.Second):
		t.Fatal("the silent relay never took the position")
	}

	healthy := newRelay(t, pool, &recorder{Publisher: b.pub}, pgoutbox.RelayConfig{})
	res, err := healthy.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Zero(t, res.Dispatched, "the position is held: nothing to send yet")
	start := time.Now()
	sent := 0
	require.Eventually(t, func() bool {
		res, err := healthy.RelayBatch(context.Background())
		if err == nil {
			sent += res.Dispatched
		}
		return sent == 10
	}, 15*time.Second, 100*time.Millisecond, "the silent relay kept the position")
	took := time.Since(start)
	t.Logf("the position came back after %s", took.Round(10*time.Millisecond))
	require.Less(t, took, 2500*time.Millisecond+2*time.Second, "past ConfirmTimeout + 2 s, with room for a loaded machine")
}
