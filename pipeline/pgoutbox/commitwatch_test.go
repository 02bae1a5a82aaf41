package pgoutbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A pool watched by a CommitWatch tells each commit of outbox rows once,
// after the commit, however it was made (pgx.BeginFunc as the README
// publishes, database/sql over the pool, an insert without a transaction),
// and never a rollback, a failed transaction's COMMIT, or a transaction
// that wrote no event.
func TestACommitWatchTellsEachCommitOfEvents(t *testing.T) {
	t.Parallel()
	schema := pipelinetest.Schema(t)
	ctx := context.Background()
	var told atomic.Int64
	watch := pgoutbox.NewCommitWatch()
	watch.OnCommit(func() { told.Add(1) })
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: pipelinetest.DatabaseURL(), Schema: schema, ApplicationName: "ferry-test-commitwatch", Configure: watch.Watch})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ob := pipelinetest.Outbox(t)
	count := func(topic string) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+testTable.Quoted()+` WHERE topic = $1`, topic).Scan(&n))
		return n
	}
	step := func(what string, want int64, f func()) {
		t.Helper()
		before := told.Load()
		f()
		require.Equal(t, want, told.Load()-before, what)
	}

	step("pgx.BeginFunc with Publish, as the README does", 1, func() {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := ob.Publish(ctx, tx, "mail.send", "u", map[string]string{"to": "a"}); err != nil {
				return err
			}
			require.Equal(t, int64(0), told.Load(), "nothing is told before the commit")
			return ob.Publish(ctx, tx, "mail.send", "u", map[string]string{"to": "b"}) // one commit, told once
		}))
	})
	step("database/sql over the pool", 1, func() { publish(t, pool, "mail.send", event(t, "u", "sql")) })
	step("an insert outside any transaction", 1, func() {
		require.NoError(t, ob.PublishTx(ctx, pgoutbox.PgxTx(pool), "mail.send", event(t, "u", "alone")))
	})
	step("a rollback", 0, func() {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			require.NoError(t, ob.Publish(ctx, tx, "rolled.back", "u", "x"))
			return errors.New("changed my mind")
		})
		require.Error(t, err)
	})
	step("a failed transaction's COMMIT (PostgreSQL rolls it back)", 0, func() {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, ob.Publish(ctx, tx, "rolled.back", "u", "x"))
		_, err = tx.Exec(ctx, `SELECT 1/0`)
		require.Error(t, err)
		require.ErrorIs(t, tx.Commit(ctx), pgx.ErrTxCommitRollback)
	})
	step("a transaction without events", 0, func() {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		}))
	})
	step("the next commit after them", 1, func() {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.Publish(ctx, tx, "mail.send", "u", "again")
		}))
	})
	require.Equal(t, 5, count("mail.send"))
	require.Zero(t, count("rolled.back"))
}

// The README's way to publish, with the relay's probes and polls off:
// only the CommitWatch of the producer's pool wakes the relay.
func TestTheReadmesCommitWakesTheRelayThroughTheWatch(t *testing.T) {
	t.Parallel()
	schema := pipelinetest.Schema(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := newBroker(t, "mail.send")
	relayPool := pipelinetest.Pool(t, schema, "ferry-test-relay")
	relay := newRelay(t, relayPool, b.pub, pgoutbox.RelayConfig{PollInterval: time.Hour, ProbeInterval: -1, PollOnly: true})
	watch := pgoutbox.NewCommitWatch()
	watch.OnCommit(relay.Wake)
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: pipelinetest.DatabaseURL(), Schema: schema, ApplicationName: "ferry-test-producer", Configure: watch.Watch})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool { return relay.Stats().Claims > 0 }, 5*time.Second, time.Millisecond, "the relay's first claim")
	time.Sleep(50 * time.Millisecond)
	ob := pipelinetest.Outbox(t)
	for i := range 3 {
		start := time.Now()
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.Publish(ctx, tx, "mail.send", "u", i)
		}))
		require.Eventually(t, func() bool { return relay.Stats().Dispatched == int64(i+1) }, 5*time.Second, time.Millisecond)
		require.Less(t, time.Since(start), time.Second, "commit %d relayed at the commit, not at the hourly poll", i)
	}
}
