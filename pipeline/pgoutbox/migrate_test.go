package pgoutbox_test

import (
	"context"
	"fmt"
	"io/fs"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// earlierRelay is a relay of the version before migration 00024, as its
// statements were: claim the due heads with FOR UPDATE SKIP LOCKED,
// publish, mark each row dispatched. Its process says so in
// ferry_instances (no relay_lanes) while it runs.
type earlierRelay struct {
	pool *pgxpool.Pool
	pub  message.Publisher
}

var earlierClaimSQL = `SELECT o.id, o.message_uuid, o.aggregate_id, o.topic, COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')), o.headers
	FROM ` + outboxSQL + ` o
	WHERE o.dispatched_at IS NULL AND o.available_at <= now()
	  AND NOT EXISTS (SELECT 1 FROM ` + outboxSQL + ` p WHERE p.aggregate_id = o.aggregate_id AND p.dispatched_at IS NULL AND p.id < o.id)
	ORDER BY o.available_at LIMIT 50
	FOR UPDATE OF o SKIP LOCKED`

func (e earlierRelay) batch(ctx context.Context) (int, error) {
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, err := tx.Query(ctx, earlierClaimSQL)
	if err != nil {
		return 0, err
	}
	type row struct {
		id         int64
		uuid       *string
		agg, topic string
		payload    []byte
		headers    map[string]string
	}
	claimed, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var c row
		return c, r.Scan(&c.id, &c.uuid, &c.agg, &c.topic, &c.payload, &c.headers)
	})
	if err != nil || len(claimed) == 0 {
		return 0, err
	}
	var ids []int64
	for _, c := range claimed {
		m := message.NewMessage(*c.uuid, c.payload)
		for k, v := range c.headers {
			m.Metadata.Set(k, v)
		}
		m.Metadata.Set(pipeline.MetaAggregateID, c.agg)
		if err := e.pub.Publish(c.topic, m); err != nil {
			return 0, err
		}
		ids = append(ids, c.id)
	}
	// As the relay did: what the broker confirmed is recorded even when
	// the relay is asked to stop meanwhile.
	fctx := context.WithoutCancel(ctx)
	if _, err := tx.Exec(fctx, `UPDATE `+outboxSQL+` SET dispatched_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`, ids); err != nil {
		return 0, err
	}
	return len(ids), tx.Commit(fctx)
}

// startProducers runs three producers, one transaction per event, eight
// aggregates each, each event's payload its "seq" within its aggregate.
// stop returns once they have stopped; produced counts what they committed.
func startProducers(t *testing.T, pool *pgxpool.Pool) (produced *atomic.Int64, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var prod sync.WaitGroup
	produced = &atomic.Int64{}
	for p := range 3 {
		prod.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				publish(t, pool, "orders.placed", event(t, fmt.Sprintf("p%d-%d", p, i%8), map[string]int{"seq": i / 8}))
				produced.Add(1)
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	return produced, func() { cancel(); prod.Wait() }
}

// `migrate up` on a live system: producers commit all along, a relay of the
// earlier version relays, the migration runs, a relay of this version
// starts beside the earlier one (which it sees alive, so it marks each row
// it sends), the earlier one stops, and this one goes on passing rows
// without marking them. No event is lost, none is relayed twice, each
// aggregate's stay in order. Then, relays stopped, `migrate down` gives
// the rows the relay passed their dispatched_at, and the earlier relay
// finds nothing left to send.
func TestMigrationToAppendOnlyUnderLoad(t *testing.T) {
	pipelinetest.RequireDefaultOutbox(t)
	t.Parallel()
	ctx := context.Background()
	schema := pipelinetest.Schema(t)
	pool := pipelinetest.Pool(t, schema, "migrate-under-load")
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { _ = db.Close() })
	// The schema as the earlier version left it (before 00024).
	pipelinetest.MigrateDownTo(t, db, 23)
	var version int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT max(version_id) FROM `+migrations.VersionTable+` WHERE is_applied`).Scan(&version))
	require.EqualValues(t, 23, version)

	b := newBroker(t, "orders.placed")
	var order confirmedOrder
	rec := &recorder{Publisher: b.pub, after: order.record}
	pub := orderedRecorder{rec, []string{"orders.placed"}}

	// The earlier relay, and its heartbeat as its process wrote it.
	_, err := pool.Exec(ctx, `INSERT INTO ferry_instances (instance_id, components, hostname, pid, version) VALUES ('earlier', 'relay', 'test', 1, 'v0.23')`)
	require.NoError(t, err)
	earlierCtx, stopEarlier := context.WithCancel(ctx)
	var earlierDone sync.WaitGroup
	earlierSent := atomic.Int64{}
	var earlierPaused atomic.Bool
	earlierDone.Go(func() {
		e := earlierRelay{pool: pool, pub: pub}
		for earlierCtx.Err() == nil {
			if earlierPaused.Load() {
				_, _ = pool.Exec(ctx, `UPDATE ferry_instances SET heartbeat_at = now() WHERE instance_id = 'earlier'`)
				time.Sleep(5 * time.Millisecond)
				continue
			}
			n, err := e.batch(earlierCtx)
			if err != nil && earlierCtx.Err() == nil {
				t.Errorf("earlier relay: %v", err)
				return
			}
			earlierSent.Add(int64(n))
			_, _ = pool.Exec(ctx, `UPDATE ferry_instances SET heartbeat_at = now() WHERE instance_id = 'earlier'`)
			time.Sleep(5 * time.Millisecond)
		}
	})

	produced, stopProducers := startProducers(t, pool)
	time.Sleep(700 * time.Millisecond)
	before := produced.Load()
	n, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	require.Equal(t, ferryMigrations(t)-23, n, "00024 to the newest")
	t.Logf("migrated with %d events produced before, %d relayed by the earlier relay", before, earlierSent.Load())

	// This version's relay, as the app starts it.
	relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{Table: testTable,
		OrderedTopics: []string{"orders.placed"}, FailoverReplay: -1,
		MarkEachRow: func(ctx context.Context) (bool, error) { return pgstatus.EarlierRelaysAlive(ctx, pool) },
	}, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	relayCtx, stopRelay := context.WithCancel(ctx)
	var relayDone sync.WaitGroup
	relayDone.Go(func() { _ = relay.Run(relayCtx) })
	time.Sleep(300 * time.Millisecond)
	// While the earlier relay is alive (here idle, so that this relay has
	// the rows to itself), every row this relay sends is marked.
	earlierPaused.Store(true)
	sentBefore := relay.Stats().Dispatched
	require.Eventually(t, func() bool { return relay.Stats().Dispatched > sentBefore+50 }, 10*time.Second, 10*time.Millisecond)
	passedUnmarked := "dispatched_at IS NULL AND " + pgoutbox.DispatchedOutbox
	require.Zero(t, countWhere(t, pool, passedUnmarked), "a row passed without a mark while a relay of the earlier version is alive")
	earlierPaused.Store(false)
	time.Sleep(300 * time.Millisecond)

	// The earlier relay stops (its process deregisters).
	stopEarlier()
	earlierDone.Wait()
	_, err = pool.Exec(ctx, `DELETE FROM ferry_instances WHERE instance_id = 'earlier'`)
	require.NoError(t, err)

	// Within the relay's next look at ferry_instances (every 5 s), rows
	// are passed without a mark.
	require.Eventually(t, func() bool {
		return countWhere(t, pool, passedUnmarked) > 0
	}, 15*time.Second, 50*time.Millisecond, "once the earlier relay stopped, rows were passed without a mark")
	time.Sleep(300 * time.Millisecond)
	stopProducers()
	total := int(produced.Load())
	rec.awaitPublished(t, total, 30*time.Second)
	stopRelay()
	relayDone.Wait()

	requireEachOnceInOrder(t, rec, total, &order)
	passedOnly := countWhere(t, pool, passedUnmarked)
	t.Logf("%d events: %d relayed by the earlier relay, %d by this version's (%d of them passed without a mark)", total, earlierSent.Load(), total-int(earlierSent.Load()), passedOnly)

	// migrate down, relays stopped: the passed rows get their
	// dispatched_at, and the earlier version finds nothing to send.
	pipelinetest.MigrateDownTo(t, db, 23)
	require.Zero(t, countWhere(t, pool, "dispatched_at IS NULL"))
	sent, err := earlierRelay{pool: pool, pub: pub}.batch(ctx)
	require.NoError(t, err)
	require.Zero(t, sent)
	_, err = migrations.Up(ctx, db)
	require.NoError(t, err)
}

// `migrate up` to partitions (00025) on a live system: producers commit
// all along and this version's relay relays while the outbox table is
// swapped for a partitioned one that takes the old table as a partition.
// No event is lost, none relayed twice, each aggregate's stay in order;
// the rows of before stay where they were (the legacy partition), the new
// ones go to the current week's. `migrate down`, relays stopped, puts every
// row back in one table.
func TestMigrationToPartitionsUnderLoad(t *testing.T) {
	pipelinetest.RequireDefaultOutbox(t)
	t.Parallel()
	ctx := context.Background()
	schema := pipelinetest.Schema(t)
	pool := pipelinetest.Pool(t, schema, "migrate-partitions-under-load")
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { _ = db.Close() })
	pipelinetest.MigrateDownTo(t, db, 24)

	b := newBroker(t, "orders.placed")
	var order confirmedOrder
	rec := &recorder{Publisher: b.pub, after: order.record}
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"orders.placed"}}, pgoutbox.RelayConfig{FailoverReplay: -1})
	relayCtx, stopRelay := context.WithCancel(ctx)
	var relayDone sync.WaitGroup
	relayDone.Go(func() { _ = relay.Run(relayCtx) })

	produced, stopProducers := startProducers(t, pool)
	time.Sleep(700 * time.Millisecond)
	before := produced.Load()
	n, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	require.Equal(t, ferryMigrations(t)-24, n, "00025 to the newest")
	t.Logf("migrated with %d events produced before", before)
	time.Sleep(700 * time.Millisecond)
	stopProducers()
	total := int(produced.Load())
	rec.awaitPublished(t, total, 30*time.Second)
	stopRelay()
	relayDone.Wait()
	requireEachOnceInOrder(t, rec, total, &order)

	legacy, current, all := countWhere(t, pool, "part = -1"), countWhere(t, pool, "part = ferry_outbox_part(now())"), countWhere(t, pool, "")
	require.Equal(t, total, all)
	require.GreaterOrEqual(t, legacy, int(before), "the rows of before stay in the table they were written to")
	require.Positive(t, current, "new rows go to the current week's partition")
	require.Equal(t, all, legacy+current)

	pipelinetest.MigrateDownTo(t, db, 24)
	var kind string
	require.NoError(t, pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = '`+outboxSQL+`'::regclass`).Scan(&kind))
	require.Equal(t, "r", kind)
	require.Equal(t, total, countWhere(t, pool, pgoutbox.DispatchedOutbox), "every row back in one table, still dispatched")
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
