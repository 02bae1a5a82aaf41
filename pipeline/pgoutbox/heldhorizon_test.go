package pgoutbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// One long transaction elsewhere (a report, pg_dump, a standby's
// feedback) keeps every row version that dies while it is open. With it
// open the whole time, producers commit events of ordered aggregates, some
// delayed, one failing at its first publish, while two relays with two
// batches in flight each relay them: every event reaches the broker exactly
// once, in order per aggregate, and the outbox holds no dead tuple but
// those of the rows that needed state of their own (the delayed and the
// failed). On a server of the test's own, autovacuum on as in production.
func TestRelayUnderAHeldHorizonLeavesNoDeadTuples(t *testing.T) {
	t.Parallel()
	srv := pipelinetest.OwnPostgres(t, "autovacuum=on", "autovacuum_naptime=1s")
	ctx := context.Background()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: srv.URL("postgres"), ApplicationName: "held-horizon", MaxConns: 16})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { _ = db.Close() })
	_, err = migrations.Up(ctx, db)
	require.NoError(t, err)
	require.NoError(t, ferrytest.RenameOutbox(ctx, pool, testTable))
	_, err = pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pgstattuple`)
	require.NoError(t, err, "pgstattuple (postgresql-contrib)")

	// The horizon held from before the first event to after the last: a
	// transaction with an xid, as a long report that wrote a temp table has.
	conn, err := pgx.Connect(ctx, srv.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.WithoutCancel(ctx)) })
	long, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	var held uint64
	require.NoError(t, long.QueryRow(ctx, `SELECT txid_current()`).Scan(&held))

	b := newBroker(t, "orders.placed", "mail.send")
	var (
		order   confirmedOrder
		failOne atomic.Bool
	)
	failOne.Store(true)
	rec := &recorder{Publisher: b.pub,
		before: func(m *message.Message) error {
			var p struct{ Seq int }
			_ = json.Unmarshal(m.Payload, &p)
			if p.Seq == 7 && m.Metadata.Get(pipeline.MetaAggregateID) == "agg-0-3" && failOne.CompareAndSwap(true, false) {
				return errors.New("broker said no, once")
			}
			return nil
		},
		after: order.record}
	pub := orderedRecorder{rec, []string{"orders.placed"}}
	cfg := pgoutbox.RelayConfig{InFlight: 2, Backoff: pipeline.Backoff{Initial: 200 * time.Millisecond, Max: 200 * time.Millisecond, Jitter: -1}, FailoverReplay: -1}
	rctx, stop := context.WithCancel(ctx)
	var relays sync.WaitGroup
	for range 2 {
		r := newRelay(t, pool, pub, cfg)
		relays.Go(func() { _ = r.Run(rctx) })
	}

	// Four producers, each with its own aggregates (so the order of an
	// aggregate is its producer's), one event per transaction, some
	// several per transaction; and each with one aggregate whose first
	// event is delayed, so that its next two wait behind it.
	const producers, perProducer = 4, 600
	start := time.Now()
	var prod sync.WaitGroup
	delayed := atomic.Int64{}
	for p := range producers {
		prod.Go(func() {
			late := fmt.Sprintf("late-%d", p)
			// 15 s: with 5, a CI run of the full suite relayed the two
			// behind it after the delay had run out.
			publish(t, pool, "orders.placed", pipeline.WithDelay(event(t, late, map[string]int{"seq": 0}), 15*time.Second))
			delayed.Add(1)
			// Its next two at once: written later in the run, on a loaded
			// machine they came after the delay had run out, and went
			// without waiting.
			publish(t, pool, "orders.placed", event(t, late, map[string]int{"seq": 1}))
			publish(t, pool, "orders.placed", event(t, late, map[string]int{"seq": 2}))
			for i := 0; i < perProducer; {
				n := 1 + i%3
				var msgs []*message.Message
				for range n {
					if i == perProducer {
						break
					}
					msgs = append(msgs, event(t, fmt.Sprintf("agg-%d-%d", p, i%5), map[string]int{"seq": i / 5}))
					i++
				}
				publish(t, pool, "orders.placed", msgs...)
			}
		})
	}
	prod.Wait()
	total := producers * (perProducer + 3)
	deadline := time.Now().Add(60 * time.Second)
	for {
		rec.mu.Lock()
		got := len(rec.published)
		rec.mu.Unlock()
		if got == total || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	secs := time.Since(start).Seconds()
	stop()
	relays.Wait()

	requireEachOnceInOrder(t, rec, total, &order)
	require.False(t, failOne.Load(), "the failing publish happened")
	require.Zero(t, countPending(t, pool, ""))

	// The horizon is still held: nothing could be vacuumed away.
	var still uint64
	require.NoError(t, long.QueryRow(ctx, `SELECT txid_current()`).Scan(&still))
	require.Equal(t, held, still)
	var dead int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum((pgstattuple(inhrelid)).dead_tuple_count) FROM pg_inherits WHERE inhparent = $1::regclass`, testTable.Quoted()).Scan(&dead))
	// Only the delayed rows, the rows behind them, the failed row and the
	// rows of its aggregate that came while it waited keep state of their
	// own; every other row was passed without a write.
	slowRows := rowsWhere(t, pool, "slow")
	slow := int64(len(slowRows))
	slowBy := map[string]int{}
	for _, r := range slowRows {
		slowBy[r.AggregateID]++
	}
	for p := range producers {
		// Delayed well past the relay's lag on a busy machine, so that
		// the position passes it before it is due.
		require.Equal(t, 3, slowBy[fmt.Sprintf("late-%d", p)], "the delayed row and the two behind it")
		delete(slowBy, fmt.Sprintf("late-%d", p))
	}
	require.Positive(t, slowBy["agg-0-3"], "the failed row")
	t.Logf("the failed row's aggregate had %d rows marked while it waited", slowBy["agg-0-3"])
	delete(slowBy, "agg-0-3")
	require.Empty(t, slowBy, "rows of the other aggregates are never marked")
	t.Logf("%d events from %d producers relayed in %.1fs (%.0f/s) with the horizon held; %d delayed, %d rows with state of their own (slow), %d dead tuples in the outbox",
		total, producers, secs, float64(total)/secs, delayed.Load(), slow, dead)
	// A slow row is updated when it is marked, when it fails and when it
	// is dispatched: at most three dead versions each. The rows sent at
	// their first try leave none.
	require.LessOrEqual(t, dead, 3*slow, "the outbox's dead tuples come from the slow rows only")
	_ = long.Rollback(ctx)
}

// A database restored into another cluster (pg_dump and pg_restore) starts
// its transaction ids anew: the relay's position is then ahead of every
// row written from now on. The relay notices, gives the rows its position
// passed their dispatched_at (not sent again), relays the rest by the slow
// lane, and starts its position anew: nothing lost, nothing twice.
func TestRelayStartsAnewWhenTheServerIsBehindItsPosition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	var now uint64
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&now))
	ahead := now + 1_000_000
	// As restored: one row the old cluster's relay passed, one it had not
	// (committed after its last move), and its position.
	insertAtTx(t, pool, "passed-before", "a", "orders.placed", "$1::bigint", ahead-10)
	insertAtTx(t, pool, "not-yet", "b", "orders.placed", "$1::bigint", ahead+5)
	placePosition(t, pool, "$1::pg_snapshot", fmt.Sprintf("%d:%d:", ahead, ahead))
	publish(t, pool, "orders.placed", event(t, "c", "written after the restore"))

	rec := &recorder{Publisher: b.pub}
	relay := newRelay(t, pool, rec, pgoutbox.RelayConfig{FailoverReplay: -1})
	for range 4 {
		_, err := relay.RelayBatch(ctx)
		require.NoError(t, err)
	}
	rec.mu.Lock()
	published := maps.Clone(rec.published)
	rec.mu.Unlock()
	require.Len(t, published, 2, "the row not passed and the new one: %v", published)
	require.Contains(t, published, "not-yet")
	require.NotContains(t, published, "passed-before")
	require.NotNil(t, rowWhere(t, pool, "message_uuid = 'passed-before'").DispatchedAt)
	require.Zero(t, countPending(t, pool, ""))

	// From now on, rows are passed by the new position again.
	publish(t, pool, "orders.placed", event(t, "d", "later"))
	_, err := relay.RelayBatch(ctx)
	require.NoError(t, err)
	rec.mu.Lock()
	require.Len(t, rec.published, 3)
	rec.mu.Unlock()
	require.Equal(t, 1, countWhere(t, pool, "aggregate_id = 'd' AND dispatched_at IS NULL AND "+pgoutbox.DispatchedOutbox), "passed, not marked")
}

// confirmedOrder keeps, per aggregate, the "seq" of each message's
// payload in the order the broker confirmed them (record is a recorder's
// after hook).
type confirmedOrder struct {
	mu   sync.Mutex
	seqs map[string][]int
}

func (c *confirmedOrder) record(m *message.Message) {
	var p struct{ Seq int }
	_ = json.Unmarshal(m.Payload, &p)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.seqs == nil {
		c.seqs = map[string][]int{}
	}
	agg := m.Metadata.Get(pipeline.MetaAggregateID)
	c.seqs[agg] = append(c.seqs[agg], p.Seq)
}

// requireEachOnceInOrder checks that total messages reached the broker,
// each once, and that each aggregate's sequence numbers (in the order
// confirmed) only grew.
func requireEachOnceInOrder(t *testing.T, rec *recorder, total int, order *confirmedOrder) {
	t.Helper()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Len(t, rec.published, total, "every event reached the broker")
	for id, n := range rec.published {
		require.Equal(t, 1, n, "message %s reached the broker %d times", id, n)
	}
	order.mu.Lock()
	defer order.mu.Unlock()
	for agg, s := range order.seqs {
		for i := 1; i < len(s); i++ {
			require.Less(t, s[i-1], s[i], "aggregate %s out of order: %v", agg, s)
		}
	}
}

// holdPosition takes the position of pool's outbox table as a relay's batch
// does, in a transaction the caller ends (rolled back when the test ends).
func holdPosition(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	var got bool
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtext('`+pgoutbox.PositionTable+`'), hashtext($1::regclass::oid::text))`, testTable.Quoted()).Scan(&got))
	require.True(t, got, "the position is free")
	return tx
}

// One relay at a time moves an outbox table's position, and only that
// table's: services with an outbox of the same name in schemas of their
// own (one database) do not wait for each other.
func TestPositionLockIsPerOutboxTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b := pipelinetest.Postgres(t), pipelinetest.Postgres(t)
	br := newBroker(t, "orders.placed")
	tx := holdPosition(t, a) // a relay of schema a in the middle of a batch

	publish(t, a, "orders.placed", event(t, "a1", 1))
	publish(t, b, "orders.placed", event(t, "b1", 1))
	res, err := newRelay(t, b, br.pub, pgoutbox.RelayConfig{FailoverReplay: -1}).RelayBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Passed, "schema b's relay is not held up by schema a's")
	res, err = newRelay(t, a, br.pub, pgoutbox.RelayConfig{FailoverReplay: -1}).RelayBatch(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Passed, "schema a's position is held by its relay in the middle of a batch")
	require.NoError(t, tx.Rollback(ctx))
	res, err = newRelay(t, a, br.pub, pgoutbox.RelayConfig{FailoverReplay: -1}).RelayBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Passed)
}

// The position's old rows are removed every thousandth move, looking only
// at the few thousand rows below the newest: while a long transaction
// holds the horizon, the rows removed before stay in the index as dead
// entries, and a removal from the first row walked them all, longer with
// every hour of the hold. Rows the narrow removal misses (a move's number
// taken by another outbox table's relay or by a rolled-back batch) go
// with every hundred-thousandth move's removal, which looks at them all.
func TestPositionRowsAreRemovedInANarrowWindow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	rec := &recorder{Publisher: b.pub}
	relay := newRelay(t, pool, rec, pgoutbox.RelayConfig{FailoverReplay: -1})
	move := func(agg string) {
		t.Helper()
		publish(t, pool, "orders.placed", event(t, agg, 1))
		res, err := relay.RelayBatch(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, res.Passed, "the batch passes the new row and moves the position")
	}
	move("first")
	// Copies of the position under chosen numbers: stragglers far below,
	// and a run of moves up to 9,998; the next move is number 10,000.
	copies := func(from, to int) {
		t.Helper()
		_, err := pool.Exec(ctx, `INSERT INTO `+pgoutbox.PositionTable+` (outbox_table, seq, snap, cur, last_tx, last_id, moved_at)
			OVERRIDING SYSTEM VALUE
			SELECT p.outbox_table, g, p.snap, p.cur, p.last_tx, p.last_id, p.moved_at
			FROM (SELECT * FROM `+pgoutbox.PositionTable+` ORDER BY seq DESC LIMIT 1) p, generate_series($1::bigint, $2::bigint) g`, from, to)
		require.NoError(t, err)
	}
	copies(10, 20)
	copies(6000, 9998)
	restart := func(at int) {
		t.Helper()
		_, err := pool.Exec(ctx, fmt.Sprintf(`ALTER TABLE %s ALTER COLUMN seq RESTART WITH %d`, pgoutbox.PositionTable, at))
		require.NoError(t, err)
	}
	count := func(from, to int) (n int) {
		t.Helper()
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgoutbox.PositionTable+` WHERE seq BETWEEN $1 AND $2`, from, to).Scan(&n))
		return n
	}
	restart(10_000)
	move("thousandth")
	require.Zero(t, count(6998, 8999), "the rows a thousand moves behind, from 3,000 below the newest read")
	require.Equal(t, 9998-9000+1, count(9000, 9998), "the last thousand stay")
	require.Equal(t, 1+11+998, count(1, 6997), "below the window nothing is looked at")
	require.Equal(t, 1, count(10_000, 10_000))

	restart(100_000)
	move("hundred-thousandth")
	require.Zero(t, count(1, 98_999), "the hundred-thousandth move's removal looks from the first row")
	require.Equal(t, 1, count(1, 100_000), "the newest move")

	rec.mu.Lock()
	require.Len(t, rec.published, 3, "each row relayed once")
	rec.mu.Unlock()
	move("after")
}

// A relay that finds the position held by another relay's batch, and
// nothing in the slow lane, waits for the position in the database: it
// neither claims nor probes meanwhile, however often it is woken (two
// relays spinning so drained at 0.7x of one, four at 0.5–0.6x), and takes
// the position as soon as the other batch ends.
func TestARelayWaitsForAHeldPositionWithoutSpinning(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool := pipelinetest.Postgres(t)
	br := newBroker(t, "orders.placed")
	tx := holdPosition(t, pool) // another relay in the middle of a batch
	publish(t, pool, "orders.placed", event(t, "a1", 1))

	relay := newRelay(t, pool, br.pub, pgoutbox.RelayConfig{FailoverReplay: -1, PollInterval: time.Hour})
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()
	defer func() { cancel(); <-done }()
	time.Sleep(200 * time.Millisecond) // its first batch found the position held
	before := relay.Stats()
	for range 200 {
		relay.Wake() // as commits of other producers would
		time.Sleep(5 * time.Millisecond)
	}
	after := relay.Stats()
	require.Zero(t, after.Dispatched, "the position is held")
	require.LessOrEqual(t, after.Claims-before.Claims, int64(2), "no claim loop while the position is held")
	require.LessOrEqual(t, after.Probes-before.Probes, int64(2), "nor a probe loop")

	require.NoError(t, tx.Rollback(ctx)) // the other batch ends
	start := time.Now()
	require.Eventually(t, func() bool { return relay.Stats().Dispatched == 1 }, 5*time.Second, time.Millisecond)
	require.Less(t, time.Since(start), time.Second, "taken as soon as it is free")
}
