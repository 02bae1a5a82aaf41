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

// With the broker connection cut, the streamer holds: nothing is recorded
// as failed, and the slot's confirmed position does not move past the rows
// it could not publish. The position is checked by what the slot still
// holds: the streamer is stopped while holding, and a new one (on the same
// cut connection, then restored) must get every one of those rows from the
// slot. Rows the position had passed would never come again: no safety
// net runs here. (An LSN bound read from the server would not do: on a
// shared server, keepalives rightly confirm positions other sessions' WAL
// reaches before these rows commit.)
func TestBrokerCutHoldsTheConfirmedPosition(t *testing.T) {
	r := newRig(t)
	p, proxied := newProxy(t, r.amqpCfg.URL)
	relay := r.relay(t, r.pool, proxied, pgoutbox.RelayConfig{})
	s, stop := r.start(t, r.pool, relay, r.cdcConfig())
	require.Eventually(t, func() bool { return s.Stats().Active }, 20*time.Second, 20*time.Millisecond)
	r.insert(t, 0, 100, 5, 10)
	r.collect(t, 100, 30*time.Second)
	r.awaitPending(t, 0, 10*time.Second)

	p.cut()
	var before pglogrepl.LSN
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()`).Scan(&before))
	r.insert(t, 100, 200, 5, 10)
	require.Eventually(t, func() bool { return s.Stats().Holding }, 20*time.Second, 20*time.Millisecond, "the streamer never noticed the cut")
	time.Sleep(2 * time.Second) // heartbeats and status updates go on meanwhile
	require.Equal(t, 200, r.pending(t))
	var recorded int
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+testTable.View(pgoutbox.StatePending)+` o WHERE (attempts > 0 OR last_error IS NOT NULL)`).Scan(&recorded))
	require.Zero(t, recorded, "an outage is not the rows' failure")
	require.Zero(t, s.Stats().Dispatched-100)
	stop() // while holding: its last report must not pass the rows either

	s2, _ := r.start(t, r.pool, relay, r.cdcConfig())
	require.Eventually(t, func() bool { return s2.Stats().Holding }, 20*time.Second, 20*time.Millisecond, "the new streamer never got the held rows from the slot")
	p.restore(t)
	got := r.collect(t, 200, 60*time.Second)
	requireInOrder(t, got, 100, 200)
	r.awaitPending(t, 0, 10*time.Second)
	require.Eventually(t, func() bool { return s2.Stats().Dispatched == 200 }, 10*time.Second, 10*time.Millisecond,
		"the held rows came from the slot's stream")
	require.Eventually(t, func() bool {
		c, err := pglogrepl.ParseLSN(r.slotStatus(t).ConfirmedLSN)
		return err == nil && c > before
	}, 15*time.Second, 50*time.Millisecond, "the confirmed position did not move once the broker was back")
	require.False(t, s2.Stats().Holding)
}
