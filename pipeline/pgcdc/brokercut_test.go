//go:build !race

package pgcdc_test

// This file is left out of `go test -race`, like pipeline/rabbit's
// reconnect test: cutting the broker connection makes watermill-amqp's
// ConnectionWrapper write its connected flag on its reconnect goroutine
// while publishers read it (IsConnected, connection.go:114 vs :139), a race
// inside the library that the detector reports whatever Ferry does. CI
// runs it without -race (.ci/run).

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

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
