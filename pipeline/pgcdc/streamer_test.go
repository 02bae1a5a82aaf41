package pgcdc_test

import (
	"context"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pipelinetest"
)

// Events committed in many transactions over few aggregates arrive once
// each, in order per aggregate; every row is marked dispatched and the
// slot's confirmed position moves past them.
func TestStreamsCommittedRowsInOrder(t *testing.T) {
	r := newRig(t)
	relay := r.relay(t, r.pool, "", pgoutbox.RelayConfig{})
	s, _ := r.start(t, r.pool, relay, r.cdcConfig())
	require.Eventually(t, func() bool { return s.Stats().Active }, 20*time.Second, 20*time.Millisecond, "the streamer never became active")
	var before pglogrepl.LSN
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()`).Scan(&before))

	r.insert(t, 0, 2000, 17, 7)
	got := r.collect(t, 2000, 60*time.Second)
	require.Zero(t, requireInOrder(t, got, 0, 2000), "no failure, so no redelivery")
	r.awaitPending(t, 0, 10*time.Second)
	require.Eventually(t, func() bool {
		lsn, err := pglogrepl.ParseLSN(r.slotStatus(t).ConfirmedLSN)
		return err == nil && lsn > before
	}, 10*time.Second, 50*time.Millisecond, "the confirmed position never passed the inserts")
	st := s.Stats()
	require.EqualValues(t, 2000, st.Dispatched)
	require.EqualValues(t, 1, st.SlotsCreated)
}

// A CDC relay process killed with SIGKILL mid-stream, twice, and started
// again: nothing is lost, order per aggregate holds, and every duplicate
// is a redelivery of a message already delivered (the ledger absorbs it).
func TestSIGKILLMidStreamLosesNothing(t *testing.T) {
	r := newRig(t)
	const total = 3000
	spawn := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"="+r.schema+" "+r.slot+" "+r.amqpCfg.Namespace)
		cmd.Stderr = os.Stderr
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	child := spawn()
	// Rows committed before the slot exists are the safety net's, which
	// this test leaves out: it proves the stream alone loses nothing.
	require.Eventually(t, func() bool { return r.slotStatus(t).Active }, 30*time.Second, 20*time.Millisecond, "the child never streamed")
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		for i := 0; i < total; i += 10 {
			r.insert(t, i, 10, 13, 10)
			time.Sleep(time.Millisecond)
		}
	}()
	var got []delivery
	seen := map[string]bool{}
	await := func(n int) {
		deadline := time.Now().Add(60 * time.Second)
		for len(seen) < n {
			for _, d := range r.drain(t) {
				got = append(got, d)
				seen[d.UUID] = true
			}
			if time.Now().After(deadline) {
				t.Fatalf("only %d of %d delivered", len(seen), n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	await(total / 4)
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_ = child.Wait()
	child = spawn()
	await(total / 2)
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_ = child.Wait()
	spawn()
	<-writerDone
	await(total)
	r.awaitPending(t, 0, 30*time.Second)
	time.Sleep(200 * time.Millisecond) // stragglers of a redelivery
	got = append(got, r.drain(t)...)
	dups := requireInOrder(t, got, 0, total)
	t.Logf("%d events, %d redelivered after the kills", total, dups)
}

// With the broker connection cut, the streamer holds: the slot's confirmed
// position does not move past the rows it could not publish, nothing is
// recorded as failed, and when the connection is back every row goes out.
func TestBrokerCutHoldsTheConfirmedPosition(t *testing.T) {
	r := newRig(t)
	p, proxied := newProxy(t, r.amqpCfg.URL)
	relay := r.relay(t, r.pool, proxied, pgoutbox.RelayConfig{})
	s, _ := r.start(t, r.pool, relay, r.cdcConfig())
	require.Eventually(t, func() bool { return s.Stats().Active }, 20*time.Second, 20*time.Millisecond)
	r.insert(t, 0, 100, 5, 10)
	r.collect(t, 100, 30*time.Second)
	r.awaitPending(t, 0, 10*time.Second)

	p.cut()
	var before pglogrepl.LSN
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()`).Scan(&before))
	r.insert(t, 100, 200, 5, 10)
	require.Eventually(t, func() bool { return s.Stats().Holding }, 20*time.Second, 20*time.Millisecond, "the streamer never noticed the cut")
	// Heartbeats and status updates go on meanwhile; the position must not.
	time.Sleep(3 * time.Second)
	confirmed, err := pglogrepl.ParseLSN(r.slotStatus(t).ConfirmedLSN)
	require.NoError(t, err)
	require.LessOrEqual(t, confirmed, before, "the confirmed position moved past unconfirmed messages")
	require.Equal(t, 200, r.pending(t))
	var recorded int
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE dispatched_at IS NULL AND (attempts > 0 OR last_error IS NOT NULL)`).Scan(&recorded))
	require.Zero(t, recorded, "an outage is not the rows' failure")

	p.restore(t)
	got := r.collect(t, 200, 60*time.Second)
	requireInOrder(t, got, 100, 200)
	r.awaitPending(t, 0, 10*time.Second)
	require.Eventually(t, func() bool {
		c, err := pglogrepl.ParseLSN(r.slotStatus(t).ConfirmedLSN)
		return err == nil && c > before
	}, 15*time.Second, 50*time.Millisecond, "the confirmed position did not move once the broker was back")
	require.False(t, s.Stats().Holding)
}

// Two streamers on one slot: one streams, the other stands by and takes
// over when the first stops.
func TestStandbyTakesOver(t *testing.T) {
	r := newRig(t)
	first, stopFirst := r.start(t, r.pool, r.relay(t, r.pool, "", pgoutbox.RelayConfig{}), r.cdcConfig())
	require.Eventually(t, func() bool { return first.Stats().Active }, 20*time.Second, 20*time.Millisecond)
	second, _ := r.start(t, pipelinetest.Pool(t, r.schema, "ferry-cdc-standby"), r.relay(t, r.pool, "", pgoutbox.RelayConfig{}), r.cdcConfig())
	r.insert(t, 0, 300, 7, 10)
	r.collect(t, 300, 30*time.Second)
	require.True(t, first.Stats().Active)
	require.False(t, second.Stats().Active, "two streamers active on one slot")
	require.Zero(t, second.Stats().Dispatched)

	stopFirst()
	require.Eventually(t, func() bool { return second.Stats().Active }, 20*time.Second, 20*time.Millisecond, "the standby never took over")
	r.insert(t, 300, 300, 7, 10)
	got := r.collect(t, 300, 30*time.Second)
	require.Zero(t, requireInOrder(t, got, 300, 300))
	require.EqualValues(t, 300, second.Stats().Dispatched)
}
