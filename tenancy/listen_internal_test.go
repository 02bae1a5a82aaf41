package tenancy

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// A listener whose session is terminated again and again comes back
// within about a second each time: its wait doubles only while the
// database refuses. (It doubled at every loss, however long the listener
// had listened: after a few, the fleet swept for 30 s after each.)
func TestAListenerTerminatedAgainAndAgainComesBackAtOnce(t *testing.T) {
	ctx := context.Background()
	url := testDatabaseURL(t)
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err, "PostgreSQL at %s", url)
	t.Cleanup(func() { _ = conn.Close(ctx) })
	// A schema name no other test notifies about: only this test's
	// NOTIFY wakes its tenant.
	schema := fmt.Sprintf("listen_test_%d", time.Now().UnixNano())
	woken := make(chan string, 64)
	ls := newListeners(func(id string) { woken <- id }, slog.New(slog.DiscardHandler))
	ls.set(ctx, map[string]map[string][]string{url: {schema: {"acme"}}})
	t.Cleanup(ls.stop)
	l := ls.m[url]
	for round := range 5 {
		started := time.Now()
		require.Eventually(t, func() bool {
			for len(woken) > 0 {
				<-woken
			}
			if _, err := conn.Exec(ctx, "SELECT pg_notify($1, $2)", pgoutbox.NotifyChannel, schema); err != nil {
				return false
			}
			select {
			case id := <-woken:
				return id == "acme"
			case <-time.After(100 * time.Millisecond):
				return false
			}
		}, 3*time.Second, 10*time.Millisecond, "round %d: the listener is back", round)
		t.Logf("round %d: listening %s after the loss", round, time.Since(started).Round(10*time.Millisecond))
		var done bool
		require.NoError(t, conn.QueryRow(ctx, "SELECT pg_terminate_backend($1)", int(l.pid.Load())).Scan(&done))
		require.True(t, done, "the listener's session is terminated")
	}
}
