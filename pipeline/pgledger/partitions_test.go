package pgledger_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The suite's own SQL over the ledger's table, named here once: rows
// written as a consumer of a given week (or of an earlier version) left
// them, and counts by a condition.

type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// insertProcessed writes a ledger row as if processed at time at: in its
// week's partition, as a consumer then would have.
func insertProcessed(t *testing.T, q querier, consumer, id string, digest []byte, at time.Time) {
	t.Helper()
	insertProcessedIn(t, q, consumer, id, digest, at, pgweeks.Of(at))
}

// insertProcessedIn writes a ledger row into partition part (-1: the
// legacy partition, the table before migration 00026).
func insertProcessedIn(t *testing.T, q querier, consumer, id string, digest []byte, at time.Time, part int) {
	t.Helper()
	_, err := q.Exec(context.Background(), `INSERT INTO `+pgledger.DefaultTable+` (consumer, message_id, payload_sha256, processed_at, part) VALUES ($1, $2, $3, $4, $5)`,
		consumer, id, digest, at, part)
	require.NoError(t, err)
}

// insertAsEarlierVersion writes a ledger row as a consumer of an earlier
// version does (no partition, no digest; a duplicate skipped), and says
// how many rows it wrote.
func insertAsEarlierVersion(q querier, consumer, id string) (int64, error) {
	tag, err := q.Exec(context.Background(), `INSERT INTO `+pgledger.DefaultTable+` (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, consumer, id)
	return tag.RowsAffected(), err
}

// countProcessed counts the ledger rows matching cond ("" counts all).
func countProcessed(t *testing.T, q querier, cond string, args ...any) int64 {
	t.Helper()
	if cond != "" {
		cond = " WHERE " + cond
	}
	var n int64
	require.NoError(t, q.QueryRow(context.Background(), `SELECT count(*) FROM `+pgledger.DefaultTable+cond, args...).Scan(&n))
	return n
}

// A message processed in an earlier week (another partition) is a
// duplicate this week too, for Once and OnceBatch alike; other content
// under its id is still told apart.
func TestLedgerKeyHoldsAcrossWeeks(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	digest := func(s string) []byte { d := sha256.Sum256([]byte(s)); return d[:] }

	weeksAgo := time.Now().Add(-3 * pgweeks.Period)
	require.NotEqual(t, pgweeks.Of(weeksAgo), pgweeks.Of(time.Now()))
	insertProcessed(t, pool, "mail", "m1", digest("a"), weeksAgo)
	insertProcessed(t, pool, "mail", "m2", digest("b"), weeksAgo)

	ran, err := ledger.Once(ctx, "mail", "m1", digest("a"), func(context.Context) error { return nil })
	require.NoError(t, err)
	require.False(t, ran, "processed three weeks ago: a duplicate")
	_, err = ledger.Once(ctx, "mail", "m1", digest("other"), func(context.Context) error { return nil })
	require.ErrorIs(t, err, pipeline.ErrIDConflict)
	ran, err = ledger.Once(ctx, "other-consumer", "m1", digest("a"), func(context.Context) error { return nil })
	require.NoError(t, err)
	require.True(t, ran, "the key is the consumer's")

	var fresh []int
	res, err := ledger.OnceBatch(ctx, "mail", []pipeline.LedgerEntry{{MessageID: "m2", Digest: digest("b")}, {MessageID: "m3", Digest: digest("c")}},
		func(_ context.Context, f []int) error { fresh = f; return nil })
	require.NoError(t, err)
	require.Equal(t, []int{1}, fresh)
	require.False(t, res[0].Ran)
	require.NoError(t, res[0].Err)

	// A writer that is not the ledger (a consumer of an earlier version
	// during a rolling upgrade) is held to the key too.
	wrote, err := insertAsEarlierVersion(pool, "mail", "m2")
	require.NoError(t, err)
	require.Zero(t, wrote)
	require.EqualValues(t, 3, countProcessed(t, pool, "consumer = 'mail'"))
}

// Two deliveries of one message across the week's turn: the first holds
// its row in last week's partition, uncommitted; the second, writing to
// this week's, waits for it, and then skips the effect if the first
// committed, or runs it if the first rolled back.
func TestLedgerDeliveriesAcrossTheWeeksTurnRunOnce(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	lastWeek := time.Now().Add(-pgweeks.Period)

	for _, commit := range []bool{true, false} {
		id := fmt.Sprintf("turn-%v", commit)
		first, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer first.Rollback(ctx) //nolint:errcheck // a no-op once committed; on a failure, frees the session
		var firstPID int
		require.NoError(t, first.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&firstPID))
		insertProcessed(t, first, "c", id, nil, lastWeek)

		var runs atomic.Int32
		var wg sync.WaitGroup
		var ran bool
		var onceErr error
		wg.Go(func() {
			ran, onceErr = ledger.Once(ctx, "c", id, nil, func(context.Context) error { runs.Add(1); return nil })
		})
		require.Eventually(t, func() bool {
			var waiting bool
			require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))`, firstPID).Scan(&waiting))
			return waiting
		}, 10*time.Second, 10*time.Millisecond, "the second delivery waits for the first")
		require.Zero(t, runs.Load())
		if commit {
			require.NoError(t, first.Commit(ctx))
		} else {
			require.NoError(t, first.Rollback(ctx))
		}
		wg.Wait()
		require.NoError(t, onceErr)
		require.Equal(t, !commit, ran, "first committed: %v", commit)
		require.EqualValues(t, map[bool]int32{true: 0, false: 1}[commit], runs.Load())
		require.EqualValues(t, 1, countProcessed(t, pool, "message_id = $1", id))
	}

	// Under REPEATABLE READ the waiting delivery's snapshot predates the
	// first's commit: it fails as a serialization conflict (and is tried
	// again), never runs the effect a second time.
	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx) //nolint:errcheck
	insertProcessed(t, first, "c", "rr", nil, lastWeek)
	second, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer second.Rollback(ctx)            //nolint:errcheck
	_, err = second.Exec(ctx, `SELECT 1`) // the snapshot, taken before the first commits
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := insertAsEarlierVersion(second, "c", "rr")
		done <- err
	}()
	time.Sleep(200 * time.Millisecond)
	require.NoError(t, first.Commit(ctx))
	err = <-done
	require.Error(t, err)
	require.Contains(t, err.Error(), "40001")
}

// Retention empties each week whose every row is past it, whole; the
// current week and the weeks within retention stay; the legacy partition
// (the table before migration 00026) is pruned row by row.
func TestLedgerRetentionClearsWholeWeeks(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	now := time.Now()
	old := now.Add(-4 * pgweeks.Period)
	for i := range 30 {
		insertProcessed(t, pool, "c", fmt.Sprintf("old-%d", i), nil, old)
	}
	insertProcessed(t, pool, "c", "recent", nil, now.Add(-pgweeks.Period))
	insertProcessed(t, pool, "c", "now", nil, now)
	insertProcessedIn(t, pool, "c", "legacy-old", nil, now.Add(-30*24*time.Hour), -1)
	insertProcessedIn(t, pool, "c", "legacy-new", nil, now.Add(-24*time.Hour), -1)

	parts, _, err := pgledger.Partitions(ctx, pool)
	require.NoError(t, err)
	require.Len(t, parts, pgweeks.Slots+1)
	cutoff := now.Add(-2 * pgweeks.Period)
	dry, err := pgledger.ClearPartitions(ctx, pool, cutoff, true)
	require.NoError(t, err)
	require.Equal(t, int64(30), dry.Rows)
	require.Len(t, dry.Partitions, 1)
	n, err := pgledger.CountBefore(ctx, pool, cutoff)
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "row by row: the legacy partition's only")

	var deadBefore int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relname LIKE 'processed_messages_p%'`).Scan(&deadBefore))
	cleared, err := pgledger.ClearPartitions(ctx, pool, cutoff, false)
	require.NoError(t, err)
	require.Equal(t, dry, cleared)
	d, err := pgledger.DeleteBefore(ctx, pool, cutoff, 100)
	require.NoError(t, err)
	require.EqualValues(t, 1, d)
	require.EqualValues(t, 3, countProcessed(t, pool, ""))
	require.EqualValues(t, 3, countProcessed(t, pool, "message_id IN ('legacy-new', 'now', 'recent')"))

	// The ring now says which weeks hold rows: last week's and this
	// week's, and the legacy partition. A consumer's insert looks there,
	// and finds last week's message.
	var oldest int64
	var legacyEmpty bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT oldest_week, legacy_empty FROM `+pgledger.RingTable).Scan(&oldest, &legacyEmpty))
	require.Equal(t, pgweeks.Week(now.Add(-pgweeks.Period)), oldest)
	require.False(t, legacyEmpty)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	for _, id := range []string{"recent", "legacy-new"} {
		ran, err := ledger.Once(ctx, "c", id, nil, func(context.Context) error { return nil })
		require.NoError(t, err)
		require.False(t, ran, "%s was processed before", id)
	}
	_, err = pgledger.DeleteBefore(ctx, pool, now.Add(time.Hour), 100)
	require.NoError(t, err)
	_, err = pgledger.ClearPartitions(ctx, pool, cutoff, false)
	require.NoError(t, err)
	require.NoError(t, pool.QueryRow(ctx, `SELECT legacy_empty FROM `+pgledger.RingTable).Scan(&legacyEmpty))
	require.True(t, legacyEmpty, "the legacy partition, emptied, is no longer looked in")

	// A lock on the partition (a consumer's long transaction read it)
	// makes it wait for the next prune, reported.
	for i := range 3 {
		insertProcessed(t, pool, "c", fmt.Sprintf("old-again-%d", i), nil, old)
	}
	reader, err := pool.Begin(ctx)
	require.NoError(t, err)
	countProcessed(t, reader, "")
	waited, err := pgledger.ClearPartitions(ctx, pool, cutoff, false)
	require.NoError(t, err)
	require.Empty(t, waited.Partitions)
	require.Len(t, waited.Waiting, 1)
	require.NoError(t, reader.Rollback(ctx))
	cleared, err = pgledger.ClearPartitions(ctx, pool, cutoff, false)
	require.NoError(t, err)
	require.EqualValues(t, 3, cleared.Rows)
}

// `migrate up` to a partitioned ledger (00026) while consumers run: every
// message's effect runs once, redeliveries of messages processed before
// the swap (now in the legacy partition) included; `migrate down` puts
// every row back in one table.
func TestLedgerMigrationUnderLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := pipelinetest.Schema(t)
	pool := pipelinetest.Pool(t, schema, "ledger-migration-under-load")
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { _ = db.Close() })
	pipelinetest.MigrateDownTo(t, db, 25)
	_, err := pool.Exec(ctx, `CREATE TABLE effects (message_id text NOT NULL)`)
	require.NoError(t, err)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)

	// Each message is delivered by two consumers at once, and again a
	// little later: a redelivery that may fall on either side of the swap.
	var next atomic.Int64
	var failures atomic.Int64
	loadCtx, stop := context.WithCancel(ctx)
	deliver := func(id string) {
		_, err := ledger.Once(ctx, "c", id, nil, func(ctx context.Context) error {
			_, err := pgledger.TxFromContext(ctx).Exec(ctx, `INSERT INTO effects VALUES ($1)`, id)
			return err
		})
		if err != nil {
			failures.Add(1)
			t.Errorf("delivery of %s: %v", id, err)
		}
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for loadCtx.Err() == nil {
				n := next.Add(1)
				id := fmt.Sprintf("m%d", n)
				var pair sync.WaitGroup
				pair.Go(func() { deliver(id) })
				pair.Go(func() { deliver(id) })
				pair.Wait()
				if n > 50 {
					deliver(fmt.Sprintf("m%d", n-50))
				}
			}
		})
	}
	time.Sleep(500 * time.Millisecond)
	before := next.Load()
	n, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	require.Equal(t, ferryMigrations(t)-25, n, "00026 to the newest")
	time.Sleep(500 * time.Millisecond)
	stop()
	wg.Wait()
	require.Zero(t, failures.Load())
	total := next.Load()
	t.Logf("%d messages, %d before the swap", total, before)

	var effects, distinct, ledgerRows, legacy int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT message_id) FROM effects`).Scan(&effects, &distinct))
	ledgerRows, legacy = countProcessed(t, pool, ""), countProcessed(t, pool, "part = -1")
	require.Equal(t, total, distinct)
	require.Equal(t, distinct, effects, "every effect ran once")
	require.Equal(t, total, ledgerRows)
	require.GreaterOrEqual(t, legacy, before-4, "the rows of before stay where they were")

	// A redelivery of a message of before the swap: a duplicate.
	ran, err := ledger.Once(ctx, "c", "m1", nil, func(context.Context) error { return nil })
	require.NoError(t, err)
	require.False(t, ran)

	pipelinetest.MigrateDownTo(t, db, 25)
	var kind string
	require.NoError(t, pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'processed_messages'::regclass`).Scan(&kind))
	require.Equal(t, "r", kind)
	require.Equal(t, total, countProcessed(t, pool, ""))
	ran, err = ledger.Once(ctx, "c", "m2", nil, func(context.Context) error { return nil })
	require.NoError(t, err)
	require.False(t, ran)
	_, err = migrations.Up(ctx, db)
	require.NoError(t, err)
}

// ferryMigrations is how many migrations Ferry's set holds.
func ferryMigrations(t *testing.T) int {
	t.Helper()
	files, err := fs.Glob(migrations.FS, "*.sql")
	require.NoError(t, err)
	return len(files)
}
