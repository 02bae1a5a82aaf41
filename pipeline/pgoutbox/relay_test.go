package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// broker is a real RabbitMQ namespace with one queue bound to topic.
type broker struct {
	topo  *rabbit.Topology
	conn  *amqp.Connection
	pub   *wamqp.Publisher
	queue string
}

func newBroker(t *testing.T, topics ...string) *broker {
	t.Helper()
	topo, err := rabbit.NewTopology(pipelinetest.Rabbit(t))
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, topo)
	conn, err := amqp.Dial(topo.Config().URL)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	b := &broker{topo: topo, conn: conn, queue: "relay-test"}
	var bindings []rabbit.Binding
	for _, topic := range topics {
		bindings = append(bindings, rabbit.Binding{Topic: topic, Queue: b.queue})
	}
	require.NoError(t, topo.Declare(conn, bindings...))
	b.pub, err = wamqp.NewPublisher(topo.PublisherConfig(), watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { b.pub.Close() })
	return b
}

// drain reads every message waiting in the test queue, by message id.
func (b *broker) drain(t *testing.T) map[string]int {
	t.Helper()
	ch, err := b.conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	seen := map[string]int{}
	for {
		d, ok, err := ch.Get(b.topo.QueueName(b.queue), true)
		require.NoError(t, err)
		if !ok {
			return seen
		}
		msg, err := rabbit.Marshaler{}.Unmarshal(d)
		require.NoError(t, err)
		seen[msg.UUID]++
	}
}

// recorder forwards to the real publisher and remembers what was confirmed.
type recorder struct {
	message.Publisher
	mu        sync.Mutex
	published map[string]int
	before    func(msg *message.Message) error // fault injected before publishing
	after     func(msg *message.Message)       // fault injected after the broker confirmed
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if r.before != nil {
			if err := r.before(m); err != nil {
				return err
			}
		}
		if err := r.Publisher.Publish(topic, m); err != nil {
			return err
		}
		r.mu.Lock()
		if r.published == nil {
			r.published = map[string]int{}
		}
		r.published[m.UUID]++
		r.mu.Unlock()
		if r.after != nil {
			r.after(m)
		}
	}
	return nil
}

// awaitPublished waits until n distinct messages reached the broker.
func (r *recorder) awaitPublished(t *testing.T, n int, timeout time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.published) >= n
	}, timeout, 20*time.Millisecond)
}

// orderedRecorder is a recorder whose topology orders topics: the relay
// takes its ordered topics from its publisher.
type orderedRecorder struct {
	*recorder
	ordered []string
}

func (o orderedRecorder) OrderedTopics() []string { return o.ordered }

func seed(t *testing.T, pool *pgxpool.Pool, topic string, n, aggregates int) {
	t.Helper()
	const chunk = 500
	for start := 0; start < n; start += chunk {
		var msgs []*message.Message
		for i := start; i < min(n, start+chunk); i++ {
			msgs = append(msgs, event(t, fmt.Sprintf("agg-%d", i%aggregates), map[string]int{"seq": i}))
		}
		publish(t, pool, topic, msgs...)
	}
}

func newRelay(t *testing.T, pool *pgxpool.Pool, pub message.Publisher, cfg pgoutbox.RelayConfig) *pgoutbox.Relay {
	t.Helper()
	if o, ok := pub.(pipeline.Ordering); ok && cfg.OrderedTopics == nil {
		cfg.OrderedTopics = o.OrderedTopics()
	}
	if cfg.Table == (pgoutbox.Table{}) {
		cfg.Table = testTable
	}
	r, err := pgoutbox.NewRelay(pool, pub, cfg, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	return r
}

// Two relays, each with several batches in flight, dispatch every row
// exactly once.
func TestTwoRelaysDispatchEachRowExactlyOnce(t *testing.T) {
	t.Parallel()
	const rows = 1000
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	seed(t, pool, "orders.placed", rows, 50)

	rec := &recorder{Publisher: b.pub}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	relays := []*pgoutbox.Relay{
		newRelay(t, pool, rec, pgoutbox.RelayConfig{BatchSize: 25, CatchUpBatchSize: 25, PollInterval: 10 * time.Millisecond}),
		newRelay(t, pool, rec, pgoutbox.RelayConfig{BatchSize: 25, CatchUpBatchSize: 25, PollInterval: 10 * time.Millisecond, InFlight: 3}),
	}
	for _, r := range relays {
		wg.Go(func() { _ = r.Run(ctx) })
	}
	pipelinetest.RequireDrained(t, pool, 60*time.Second)
	cancel()
	wg.Wait()

	require.Len(t, rec.published, rows)
	for id, n := range rec.published {
		require.Equal(t, 1, n, "message %s published %d times", id, n)
	}
	s0, s1 := relays[0].Stats(), relays[1].Stats()
	require.EqualValues(t, rows, s0.Dispatched+s1.Dispatched)
	require.NotZero(t, s0.Dispatched, "relay 0 took no share")
	require.NotZero(t, s1.Dispatched, "relay 1 took no share")

	atBroker := b.drain(t)
	require.Len(t, atBroker, rows)
	for id, n := range atBroker {
		require.Equal(t, 1, n, "message %s reached the broker %d times", id, n)
	}
	require.Zero(t, countWhere(t, pool, "NOT "+pgoutbox.DispatchedOutbox))
	require.Zero(t, countWhere(t, pool, "attempts <> 0"), "a row dispatched at its first try keeps no state of its own")
}

func TestRelayCarriesIDAndHeaders(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "mail.send")
	ctx := pipeline.ContextWithCorrelationID(context.Background(), "corr-7")
	ctx = pipeline.ContextWithTraceParent(ctx, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	msg, err := pipeline.NewEvent(ctx, "user-9", map[string]string{"to": "x"})
	require.NoError(t, err)
	publish(t, pool, "mail.send", msg)
	id := rowWhere(t, pool, "").ID

	res, err := newRelay(t, pool, b.pub, pgoutbox.RelayConfig{}).RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, pgoutbox.BatchResult{Claimed: 1, Passed: 1, Dispatched: 1}, res)

	ch, err := b.conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	d, ok, err := ch.Get(b.topo.QueueName(b.queue), true)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, uint8(amqp.Persistent), d.DeliveryMode)
	got, err := rabbit.Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, msg.UUID, got.UUID, "the publisher's message UUID travels end to end")
	require.Equal(t, fmt.Sprint(id), got.Metadata.Get(pipeline.MetaOutboxID), "the outbox id travels in metadata")
	require.Equal(t, "user-9", got.Metadata.Get(pipeline.MetaAggregateID))
	require.Equal(t, "corr-7", got.Metadata.Get(pipeline.MetaCorrelationID))
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", got.Metadata.Get(pipeline.MetaTraceID))
	require.Equal(t, "1", got.Metadata.Get(pipeline.MetaOutboxAttempt))
	require.NotEmpty(t, got.Metadata.Get(pipeline.MetaOutboxCreatedAt))
	require.JSONEq(t, `{"to":"x"}`, string(got.Payload))
}

func TestRelayFailureBacksOffAndRecordsError(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "stripe.charge")
	publish(t, pool, "stripe.charge", event(t, "bad", 1), event(t, "good", 2))
	rec := &recorder{Publisher: b.pub, before: func(m *message.Message) error {
		if m.Metadata.Get(pipeline.MetaAggregateID) == "bad" {
			return errors.New("broker said no")
		}
		return nil
	}}
	relay := newRelay(t, pool, rec, pgoutbox.RelayConfig{Backoff: pipeline.Backoff{Initial: time.Hour, Max: 10 * time.Hour, Jitter: -1}})

	res, err := relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, pgoutbox.BatchResult{Claimed: 2, Passed: 2, Dispatched: 1, Failed: 1}, res)

	bad := rowWhere(t, pool, "aggregate_id = 'bad'")
	require.Equal(t, 1, bad.Attempts)
	require.Contains(t, bad.LastError, "broker said no")
	require.InDelta(t, time.Hour.Seconds(), time.Until(bad.AvailableAt).Seconds(), 5)
	require.False(t, bad.Dispatched)

	// Not due again: the next batch leaves it alone.
	res, err = relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Zero(t, res.Claimed)

	// Due again (an operator's "retry now"): the second failure doubles the delay.
	updateWhere(t, pool, "available_at = now()", "aggregate_id = 'bad'")
	_, err = relay.RelayBatch(context.Background())
	require.NoError(t, err)
	bad = rowWhere(t, pool, "aggregate_id = 'bad'")
	require.Equal(t, 2, bad.Attempts)
	require.InDelta(t, (2 * time.Hour).Seconds(), time.Until(bad.AvailableAt).Seconds(), 5)
}

func TestRelayHoldsDelayedRowsUntilDue(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "mail.send")
	publish(t, pool, "mail.send", pipeline.WithDelay(event(t, "u1", "welcome"), 1500*time.Millisecond))
	relay := newRelay(t, pool, b.pub, pgoutbox.RelayConfig{})

	res, err := relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Zero(t, res.Claimed, "relayed before its available_at")

	time.Sleep(1600 * time.Millisecond)
	res, err = relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, res.Dispatched)
	require.Len(t, b.drain(t), 1)
}

func TestClaimUsesPartialIndex(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	first := insertBulk(t, pool, 20000, 100, "t", true)
	seed(t, pool, "t", 10, 3)
	analyze(t, pool)

	claim := func(ordered bool) string {
		return strings.NewReplacer("@limit", "100", "@topics::text[]", "ARRAY['t']").Replace(testTable.ClaimSQL(ordered))
	}
	// The partition holding the rows (the other weeks of the ring are
	// empty, and the planner reads them without an index).
	part := rowWhere(t, pool, "id = $1", first).Partition
	plan := explain(t, pool, claim(false))
	t.Logf("claim plan:\n%s", plan)
	require.Contains(t, plan, "Index Scan using "+part+"_slow_available_at_idx on "+part+" ", plan)

	plan = explain(t, pool, claim(true))
	t.Logf("ordered claim plan:\n%s", plan)
	require.Contains(t, plan, part+"_slow_available_at_idx", plan)
	require.NotContains(t, plan, "Seq Scan on "+part+" ", "the head check must use the slow lane's partial indexes:\n%s", plan)
	require.Contains(t, plan, part+"_aggregate_tx_idx", "the head check of rows not passed yet must use the (aggregate_id, tx) index:\n%s", plan)
}

// The readers of what is pending (status, the console, the metrics'
// gauges, ferrytest) read the rows the relay has not passed by the tx
// index, whatever they filter on, however many passed rows the outbox
// keeps (30 days by default): a retry gauge's "topic = 'ferry.retry'"
// made the planner scan every passed row, every 15 s. The rows the
// caller's own transaction wrote count as pending to it, and so does a row
// restored with a tx above every id the cluster has given.
func TestPendingReadsGoByIndexPastPassedRows(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	var first int64
	for i := range 20 {
		id := insertBulk(t, pool, 2000, 100, "t", false)
		if i == 0 {
			first = id
		}
	}
	// The relay's position past them, as a move writes it.
	placePosition(t, pool, "pg_current_snapshot()")
	pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{AggregateID: "r", Topic: pipeline.RetryTopic},
		pipelinetest.OutboxRow{AggregateID: "r", Topic: pipeline.RetryTopic},
		pipelinetest.OutboxRow{AggregateID: "n", Topic: "t"})
	analyze(t, pool)
	part := rowWhere(t, pool, "id = $1", first).Partition

	for _, q := range []string{
		pendingSelect("count(*)", `WHERE topic = '`+pipeline.RetryTopic+`'`),
		pendingSelect("topic, count(*)", "GROUP BY topic"),
		pendingSelect("count(*)", ""),
	} {
		plan := explain(t, pool, q)
		require.False(t, strings.Contains(plan, "Seq Scan on "+part+" "), "%s\nreads every passed row:\n%s", q, plan)
	}

	count := func(q pgx.Tx) (retries, all int) {
		var db querier = pool
		if q != nil {
			db = q
		}
		return countPending(t, db, "topic = $1", pipeline.RetryTopic), countPending(t, db, "")
	}
	retries, all := count(nil)
	require.Equal(t, [2]int{2, 3}, [2]int{retries, all})
	// Another transaction is in progress (its id below the caller's), so
	// the caller's own id is above its snapshot's xmax.
	other, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx)
	_, err = other.Exec(ctx, `SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	own, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer own.Rollback(ctx)
	pipelinetest.InsertOutbox(t, own, testTable, pipelinetest.OutboxRow{AggregateID: "r", Topic: pipeline.RetryTopic})
	retries, all = count(own)
	require.Equal(t, [2]int{3, 4}, [2]int{retries, all}, "the caller's own rows are pending to it")
	require.NoError(t, own.Rollback(ctx))

	// A row restored from a dump of a cluster whose ids were ahead of
	// this one's: its tx is above every id this cluster has given.
	insertAtTx(t, pool, "", "restored", "t", "pg_snapshot_xmax(pg_current_snapshot())::text::bigint + 1000000")
	retries, all = count(nil)
	require.Equal(t, [2]int{2, 4}, [2]int{retries, all}, "a restored row with a tx ahead of the cluster's is pending")
}

// A batch in progress passed part of its range: the pending reads count
// what it passed by the range's snapshot and its last row, read once for
// the statement, not joined to every row, and agree row for
// row with DispatchedCond, which does look it up per row: a transaction
// in progress at the position that committed into the range, one in
// progress at the range's snapshot that committed after it (its rows
// below the last one passed, and still pending), the rows past the last
// one, and newer rows.
func TestPendingReadsCountABatchInProgress(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	insert := func(db querier, n int) { insertBulk(t, db, n, 0, "t", false) }
	begin := func() pgx.Tx {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return tx
	}
	commit := func(tx pgx.Tx) { require.NoError(t, tx.Commit(ctx)) }

	atPosition := begin() // in progress when the position is taken
	insert(atPosition, 5)
	placePosition(t, pool, "pg_current_snapshot()")
	commit(atPosition)
	atRange := begin() // in progress when the range's snapshot is taken
	insert(atRange, 3)
	for range 20 {
		insert(pool, 100)
	}
	// The batch passed the first 950 rows of those 20 transactions (the
	// rows of the one still in progress are not visible here).
	passBatch(t, pool, 5+949)
	commit(atRange)
	insert(pool, 7)
	analyze(t, pool)

	n, err := testTable.PendingCount(ctx, pool)
	require.NoError(t, err)
	require.EqualValues(t, 3+1050+7, n)
	require.EqualValues(t, countWhere(t, pool, "NOT "+pgoutbox.DispatchedOutbox), n)
	require.Zero(t, countWhere(t, pool, `(NOT `+pgoutbox.DispatchedOutbox+`) IS DISTINCT FROM (o.id IN (`+pendingSelect("o.id", "")+`))`),
		"the pending reads and DispatchedCond disagree on some rows")

	plan := explain(t, pool, pendingSelect("count(*)", ""))
	require.NotContains(t, plan, "SubPlan", "the position is read per row:\n%s", plan)
	require.NotContains(t, plan, "Anti Join", "the position is joined to every row:\n%s", plan)
}

func TestRelayCrashAfterConfirmRedelivers(t *testing.T) {
	t.Parallel()
	schema := pipelinetest.Schema(t)
	appName := pipelinetest.UniqueName("ferry-relay-")
	relayPool := pipelinetest.Pool(t, schema, appName)
	admin := pipelinetest.Pool(t, schema, "ferry-test-admin")
	b := newBroker(t, "stripe.charge")
	publish(t, admin, "stripe.charge", event(t, "order-1", 1))

	crash := true
	rec := &recorder{Publisher: b.pub, after: func(*message.Message) {
		if !crash {
			return
		}
		// The broker has confirmed the message; now the relay's database
		// connection dies before the relay's position moves past the row.
		_, err := admin.Exec(context.Background(),
			`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, appName)
		require.NoError(t, err)
	}}
	relay := newRelay(t, relayPool, rec, pgoutbox.RelayConfig{})
	_, err := relay.RelayBatch(context.Background())
	require.Error(t, err, "the outcome cannot be recorded on a dead connection")

	crashed := rowWhere(t, admin, "")
	require.False(t, crashed.Dispatched)
	require.Zero(t, crashed.Attempts, "nothing of the crashed batch was recorded")

	crash = false
	res, err := relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, res.Dispatched)

	atBroker := b.drain(t)
	require.Len(t, atBroker, 1, "one message id")
	for id, n := range atBroker {
		require.Equal(t, 2, n, "message %s must be delivered again after the crash (at least once)", id)
	}
}

// A failing head event of an ordered topic holds back the later events of
// its aggregate, but neither other aggregates nor unordered topics.
func TestFailingHeadHoldsBackOnlyItsOrderedAggregate(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "stripe.charge", "mail.send")
	publish(t, pool, "stripe.charge", event(t, "A", "charge-1"), event(t, "A", "charge-2"), event(t, "B", "charge-1"))
	publish(t, pool, "mail.send", event(t, "A", "mail"))
	headID := map[string]bool{}
	aHead := rowsWhere(t, pool, "aggregate_id = 'A'")[0].ID
	headID[fmt.Sprint(aHead)] = true
	rec := &recorder{Publisher: b.pub, before: func(m *message.Message) error {
		if headID[m.Metadata.Get(pipeline.MetaOutboxID)] {
			return errors.New("provider of A is down")
		}
		return nil
	}}
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"stripe.charge"}}, pgoutbox.RelayConfig{
		Backoff: pipeline.Backoff{Initial: 50 * time.Millisecond, Max: 50 * time.Millisecond, Jitter: -1},
	})
	for range 5 {
		_, err := relay.RelayBatch(context.Background())
		require.NoError(t, err)
		time.Sleep(60 * time.Millisecond) // past the head's backoff: it is retried, and fails again
	}
	var pendingA []string
	for _, r := range rowsWhere(t, pool, "NOT "+pgoutbox.DispatchedOutbox) {
		pendingA = append(pendingA, r.Payload)
	}
	require.Equal(t, []string{`"charge-1"`, `"charge-2"`}, pendingA, "A's charges wait behind their failing head; B's charge and A's mail went")
	heldBack := rowWhere(t, pool, "aggregate_id = 'A' AND topic = 'stripe.charge' AND id > $1", aHead)
	require.Zero(t, heldBack.Attempts, "the held-back event was never tried")

	delete(headID, fmt.Sprint(aHead)) // provider back
	for range 4 {
		time.Sleep(60 * time.Millisecond)
		_, err := relay.RelayBatch(context.Background())
		require.NoError(t, err)
	}
	pipelinetest.RequireDrained(t, pool, 5*time.Second)
	require.Len(t, rec.published, 4)
}

// A producer in another process wakes a sleeping relay once its
// transaction committed (the Waker's NOTIFY, sent after the commit): with
// InTx, with PublishTx under pipeline.WithAfterCommit, and with
// Outbox.Committed. Nothing inside the producing transaction notifies (no
// trigger, so no instance-wide lock at its commit): with probing off, a
// commit that says nothing is found by the poll only.
func TestRelayWakesAfterTheCommit(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "mail.send")
	// A poll interval far longer than the test, and no probe: only a
	// wake-up is in time.
	relay := newRelay(t, pool, b.pub, pgoutbox.RelayConfig{PollInterval: time.Hour, ProbeInterval: -1})
	ctx := runRelay(t, relay)

	// The producer: an outbox and a waker of its own, as in another process.
	ob := pipelinetest.Outbox(t)
	waker := pgoutbox.NewWaker(pool, pgoutbox.WakerConfig{})
	ob.SetWaker(waker)
	wctx, cancel := context.WithCancel(ctx)
	wdone := make(chan struct{})
	go func() { defer close(wdone); _ = waker.Run(wctx) }()
	defer func() { cancel(); <-wdone }()
	waitAsleep(t, relay)

	// Unannounced: the row waits for the poll.
	publish(t, pool, "mail.send", event(t, "u", "silent"))
	time.Sleep(time.Second)
	require.Zero(t, relay.Stats().Dispatched, "nothing in the transaction woke the relay")
	require.Zero(t, waker.Sent())

	dispatched := int64(0)
	waitDispatched := func(what string) {
		t.Helper()
		dispatched++
		start := time.Now()
		require.Eventually(t, func() bool { return relay.Stats().Dispatched >= dispatched }, 5*time.Second, time.Millisecond, what)
		require.Less(t, time.Since(start), 2*time.Second, what)
	}
	// InTx: the silent row goes with it, woken by the one after.
	require.NoError(t, ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
		return p.PublishEvents(ctx, pipeline.Outgoing{Topic: "mail.send", Msg: event(t, "u", "in-tx")})
	}))
	dispatched++ // the silent one
	waitDispatched("InTx wakes the relay after its commit")

	// PublishTx in a transaction of the caller's, the commit announced.
	pctx, committed := pipeline.WithAfterCommit(ctx)
	tx, err := pool.Begin(pctx)
	require.NoError(t, err)
	require.NoError(t, ob.PublishTx(pctx, pgoutbox.PgxTx(tx), "mail.send", event(t, "u", "after-commit")))
	require.NoError(t, tx.Commit(pctx))
	committed()
	waitDispatched("WithAfterCommit wakes the relay")

	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, ob.PublishTx(ctx, pgoutbox.PgxTx(tx), "mail.send", event(t, "u", "committed")))
	require.NoError(t, tx.Commit(ctx))
	ob.Committed()
	waitDispatched("Outbox.Committed wakes the relay")
	require.GreaterOrEqual(t, waker.Sent(), int64(3))
	pipelinetest.RequireDrained(t, pool, 5*time.Second)
}

// With the default configuration, every commit that writes the outbox is
// relayed promptly, announced or not: a PublishTx in the caller's own
// transaction (pgx or database/sql) that never calls Committed, a plain
// INSERT as a program in another language makes, and a delayed row once it
// is due. The idle relay's probe finds them (the poll here is an hour, and
// no waker runs, nor a CommitWatch on the pool). A row a claim could not take (an ordered aggregate's
// successor behind a head in backoff) does not make the probe claim in a
// loop.
func TestIdleRelayFindsUnannouncedCommits(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "mail.send", "stripe.charge")
	rec := &recorder{Publisher: b.pub}
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"stripe.charge"}}, pgoutbox.RelayConfig{PollInterval: time.Hour})
	ctx := runRelay(t, relay)
	time.Sleep(100 * time.Millisecond) // the relay has claimed nothing and idles

	ob := pipelinetest.Outbox(t)
	dispatched := int64(0)
	relayed := func(what string) {
		t.Helper()
		dispatched++
		start := time.Now()
		require.Eventually(t, func() bool { return relay.Stats().Dispatched >= dispatched }, 5*time.Second, time.Millisecond, what)
		require.Less(t, time.Since(start), time.Second, what)
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, ob.PublishTx(ctx, pgoutbox.PgxTx(tx), "mail.send", event(t, "u", "pgx")))
	require.NoError(t, tx.Commit(ctx))
	relayed("PublishTx in a pgx transaction, no Committed")

	publish(t, pool, "mail.send", event(t, "u", "database/sql"))
	relayed("PublishTx in a database/sql transaction, no Committed")

	pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{AggregateID: "u", Topic: "mail.send", Payload: `{"from":"another program"}`})
	relayed("a plain INSERT")

	pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{AggregateID: "u", Topic: "mail.send", AvailableAt: time.Now().Add(300 * time.Millisecond)})
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, dispatched, relay.Stats().Dispatched, "a delayed row waits")
	relayed("a delayed row once due")

	// An ordered head in backoff for an hour, its successor due behind it:
	// nothing a claim could take, so the probe says no.
	pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{AggregateID: "A", Topic: "stripe.charge", AvailableAt: time.Now().Add(time.Hour)},
		pipelinetest.OutboxRow{AggregateID: "A", Topic: "stripe.charge"})
	// A second: about 100 probes on a quiet machine; a CI run of the full
	// suite once got 10 in half a second.
	time.Sleep(100 * time.Millisecond) // the commit's own wake-up and claim
	before := relay.Stats()
	time.Sleep(time.Second)
	after := relay.Stats()
	require.Equal(t, dispatched, after.Dispatched)
	n := after.Probes - before.Probes
	require.Greater(t, n, int64(10), "the idle relay keeps probing, about every 10ms")
	require.Less(t, n, int64(200), "and no faster")
	// A probe that ignored the ordered head would say yes to every look,
	// and each yes is a claim that finds nothing (about 100 a second).
	require.LessOrEqual(t, after.Claims-before.Claims, int64(2), "a successor behind its head makes no claim loop: the probe says no")

	// 2 s after its last work the relay's probes cool, spacing out up to
	// IdleProbeInterval (500 ms): about two a second, where a hot relay
	// makes a hundred, and no claim (the hour's poll).
	time.Sleep(2500 * time.Millisecond)
	before = relay.Stats()
	time.Sleep(2 * time.Second)
	after = relay.Stats()
	require.GreaterOrEqual(t, after.Probes-before.Probes, int64(2), "a cooled relay still probes")
	require.LessOrEqual(t, after.Probes-before.Probes, int64(6), "about every 500ms")
	require.Equal(t, before.Claims, after.Claims)
	// It still finds a commit nobody announced, within IdleProbeInterval.
	pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{AggregateID: "u", Topic: "mail.send", Payload: `{"from":"after a silence"}`})
	relayed("a plain INSERT after a silence")
}

// A backlog of an ordered aggregate drains at claim speed: a claim holds
// only the aggregate's head, and the relay claims again at once after
// sending one, instead of a row per aggregate per PollInterval (an hour
// here: only the immediate re-claim can drain it in time).
func TestOrderedBacklogDrainsWithoutWaitingForThePoll(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "stripe.charge")
	rec := &recorder{Publisher: b.pub}
	const perAggregate = 30
	for i := range perAggregate {
		publish(t, pool, "stripe.charge", event(t, "A", fmt.Sprintf("a-%d", i)), event(t, "B", fmt.Sprintf("b-%d", i)))
	}
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"stripe.charge"}}, pgoutbox.RelayConfig{PollInterval: time.Hour, PollOnly: true})
	runRelay(t, relay)
	pipelinetest.RequireDrained(t, pool, 20*time.Second)
	require.Len(t, rec.published, 2*perAggregate)
}

// Dispatch latency counts from when a row became due, not from its
// creation: a delay that was asked for (a scheduled event, a durable
// retry's backoff) is not the relay being slow. A row in the relay's own
// backoff keeps its first due time, so that wait does count.
func TestDispatchLatencyCountsFromDue(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "mail.send")
	publish(t, pool, "mail.send", pipeline.WithDelay(event(t, "later", "welcome"), time.Hour), event(t, "now", "hi"))
	updateWhere(t, pool, `available_at = now() - interval '1 second', due_at = now() - interval '1 second',
		created_at = now() - interval '1 hour 1 second'`, "aggregate_id = 'later'") // as if an hour had passed
	var outcomes []pgoutbox.Outcome
	relay := newRelay(t, pool, b.pub, pgoutbox.RelayConfig{Observer: func(o []pgoutbox.Outcome) { outcomes = append(outcomes, o...) }})
	_, err := relay.RelayBatch(context.Background())
	require.NoError(t, err)
	require.Len(t, outcomes, 2)
	for _, o := range outcomes {
		require.Less(t, o.At.Sub(o.DueAt), 30*time.Second, "%s: counted from due", o.Msg.Metadata.Get(pipeline.MetaAggregateID))
	}

	publish(t, pool, "mail.send", event(t, "failing", "x"))
	written := rowWhere(t, pool, "aggregate_id = 'failing'")
	require.NotNil(t, written.DueAt)
	require.Equal(t, written.AvailableAt, *written.DueAt, "due as written")
	failing := newRelay(t, pool, &recorder{Publisher: b.pub, before: func(*message.Message) error { return errors.New("no") }},
		pgoutbox.RelayConfig{Backoff: pipeline.Backoff{Initial: time.Hour, Max: time.Hour, Jitter: -1}})
	_, err = failing.RelayBatch(context.Background())
	require.NoError(t, err)
	failed := rowWhere(t, pool, "aggregate_id = 'failing'")
	require.Equal(t, *written.DueAt, *failed.DueAt, "the relay's backoff moves available_at, not due_at")
	require.True(t, failed.AvailableAt.After(written.AvailableAt.Add(50*time.Minute)))
}

// A busy ordered aggregate held behind a failure drains in runs: once
// its head goes through, the rows that waited behind it go in the same
// batch, in order (in waves), not one per batch; another relay holding the
// head keeps the whole run back.
func TestHeldOrderedAggregateDrainsInRunsAfterAFailure(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	b := newBroker(t, "o")
	var order confirmedOrder
	var failing atomic.Bool
	failing.Store(true)
	rec := &recorder{Publisher: b.pub, after: order.record, before: func(m *message.Message) error {
		if failing.Load() && m.Metadata.Get(pipeline.MetaAggregateID) == "A" {
			return errors.New("provider of A is down")
		}
		return nil
	}}
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"o"}}, pgoutbox.RelayConfig{
		BatchSize: 500, FailoverReplay: -1,
		Backoff: pipeline.Backoff{Initial: 50 * time.Millisecond, Max: 50 * time.Millisecond, Jitter: -1},
	})
	publish(t, pool, "o", event(t, "A", map[string]int{"seq": 0}))
	res, err := relay.RelayBatch(ctx)
	require.NoError(t, err)
	require.Positive(t, res.Failed)
	require.Zero(t, res.Dispatched)
	const behind = 150
	var msgs []*message.Message
	for i := 1; i <= behind; i++ {
		msgs = append(msgs, event(t, "A", map[string]int{"seq": i}), event(t, fmt.Sprintf("B%d", i%10), map[string]int{"seq": i}))
	}
	publish(t, pool, "o", msgs...)
	res, err = relay.RelayBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, behind, res.Dispatched, "the other aggregates go; A's rows wait behind its head")

	failing.Store(false)
	time.Sleep(60 * time.Millisecond)
	// Another relay holds A's head: the run stays back, nothing overtakes.
	other, err := pool.Begin(ctx)
	require.NoError(t, err)
	lockRows(t, other, "id = $1", rowsWhere(t, pool, "aggregate_id = 'A'")[0].ID)
	res, err = relay.RelayBatch(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Dispatched)
	require.NoError(t, other.Rollback(ctx))

	res, err = relay.RelayBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, behind+1, res.Dispatched, "the head and the whole run behind it, in one batch")
	requireEachOnceInOrder(t, rec, 2*behind+1, &order)
	pipelinetest.RequireDrained(t, pool, 5*time.Second)
}

// The slow lane claims the heads of held ordered aggregates before the
// rows behind them, whatever their due times. Rows held behind a failing
// head keep the due time they were written with, earlier than the head's
// backoff; claimed by due time alone, a page of them (more than a batch,
// across aggregates) held no head, so nothing in it could go, and the next
// claim took the same page: the ordered topics stalled for good after a
// broker outage, or after a failover replay (every row due at once, in
// the order their new versions lie in the table).
func TestHeldOrderedAggregatesDrainWhenTheirRowsOutnumberABatch(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	b := newBroker(t, "o")
	var order confirmedOrder
	var failing atomic.Bool
	failing.Store(true)
	rec := &recorder{Publisher: b.pub, after: order.record, before: func(m *message.Message) error {
		if failing.Load() {
			return errors.New("the broker is away")
		}
		return nil
	}}
	const aggregates, behind, batch = 10, 3, 5
	relay := newRelay(t, pool, orderedRecorder{rec, []string{"o"}}, pgoutbox.RelayConfig{
		BatchSize: batch, FailoverReplay: -1,
		// Long enough that no head comes due again within a phase of the
		// test on a loaded CI machine (300 ms did once: the slow lane then
		// retried the heads the append lane had just failed).
		Backoff: pipeline.Backoff{Initial: 3 * time.Second, Max: 3 * time.Second, Jitter: -1},
	})
	var heads []*message.Message
	for a := range aggregates {
		heads = append(heads, event(t, fmt.Sprintf("A%d", a), map[string]int{"seq": 0}))
	}
	publish(t, pool, "o", heads...)
	for range aggregates / batch {
		res, err := relay.RelayBatch(ctx)
		require.NoError(t, err)
		require.Equal(t, batch, res.Failed)
	}
	var msgs []*message.Message
	for i := 1; i <= behind; i++ {
		for a := range aggregates {
			msgs = append(msgs, event(t, fmt.Sprintf("A%d", a), map[string]int{"seq": i}))
		}
	}
	publish(t, pool, "o", msgs...)
	var held int
	for range 2 * aggregates * behind / batch {
		res, err := relay.RelayBatch(ctx)
		require.NoError(t, err)
		require.Zero(t, res.Dispatched, "held behind their heads")
		held = heldBehindHeads(rowsWhere(t, pool, "slow"))
		if held == aggregates*behind {
			break
		}
	}
	require.Equal(t, aggregates*behind, held, "the rows behind are held, due before their heads")

	failing.Store(false)
	time.Sleep(3050 * time.Millisecond) // the heads' backoff
	for i := 0; i < 4*aggregates*(behind+1)/batch; i++ {
		if _, err := relay.RelayBatch(ctx); err != nil {
			require.NoError(t, err)
		}
	}
	requireEachOnceInOrder(t, rec, aggregates*(behind+1), &order)
	pipelinetest.RequireDrained(t, pool, 5*time.Second)
}

// A relay that is behind reads the rows committed since its position in
// pages of CatchUpBatchSize after a full page, back to BatchSize once a page
// is not full; large payloads keep a catch-up page near 8 MiB.
func TestFastLaneCatchesUpInLargerPages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "orders.placed")
	relay := newRelay(t, pool, &recorder{Publisher: b.pub}, pgoutbox.RelayConfig{BatchSize: 100, CatchUpBatchSize: 1000})
	pages := func() []int {
		t.Helper()
		var got []int
		for {
			res, err := relay.RelayBatch(ctx)
			require.NoError(t, err)
			if res.Passed == 0 {
				return got
			}
			got = append(got, res.Passed)
		}
	}

	seed(t, pool, "orders.placed", 2300, 50)
	require.Equal(t, []int{100, 1000, 1000, 200}, pages(), "behind: full pages grow to CatchUpBatchSize")
	seed(t, pool, "orders.placed", 150, 50)
	require.Equal(t, []int{100, 50}, pages(), "a page that was not full brought the size back to BatchSize")

	// 40 kB payloads: a catch-up page of about 8 MiB.
	var msgs []*message.Message
	for i := range 500 {
		msgs = append(msgs, event(t, "big", map[string]string{"seq": fmt.Sprintf("%05d", i), "pad": strings.Repeat("x", 40_000)}))
	}
	publish(t, pool, "orders.placed", msgs...)
	var size int
	for _, r := range rowsWhere(t, pool, "aggregate_id = 'big'") {
		size = max(size, len(r.Payload), len(r.Raw))
	}
	catchUp := (8 << 20) / size
	require.Greater(t, catchUp, 100)
	require.Less(t, catchUp, 400)
	require.Equal(t, []int{100, catchUp, 500 - 100 - catchUp}, pages())

	// Nothing lost, nothing twice.
	atBroker := b.drain(t)
	require.Len(t, atBroker, 2300+150+500)
	for id, n := range atBroker {
		require.Equal(t, 1, n, "message %s reached the broker %d times", id, n)
	}
}

func TestRelayConfigCatchUpBatchSize(t *testing.T) {
	t.Parallel()
	c := pgoutbox.RelayConfig{}.WithDefaults()
	require.Equal(t, pgoutbox.DefaultRelayCatchUpBatchSize, c.CatchUpBatchSize)
	require.Equal(t, 5000, pgoutbox.RelayConfig{BatchSize: 5000}.WithDefaults().CatchUpBatchSize, "never below BatchSize by default")
	c.CatchUpBatchSize = 50
	require.ErrorContains(t, c.Validate(), "RelayConfig.CatchUpBatchSize must be in [BatchSize (100), 10000], got 50")
}

// heldBehindHeads counts the slow rows never tried, not marked, due
// before the earliest failed head's retry: the rows a held head keeps back.
func heldBehindHeads(slow []outboxRow) int {
	var firstRetry time.Time
	for _, r := range slow {
		if r.Attempts > 0 && (firstRetry.IsZero() || r.AvailableAt.Before(firstRetry)) {
			firstRetry = r.AvailableAt
		}
	}
	held := 0
	for _, r := range slow {
		if r.Attempts == 0 && r.DispatchedAt == nil && r.AvailableAt.Before(firstRetry) {
			held++
		}
	}
	return held
}

// A producer that never runs its Waker (a program that builds an app only
// to publish, and never calls Run) still wakes a sleeping relay at the
// commit: the first Committed starts a Run of the Waker's own, and Close
// ends it.
func TestAWakerNobodyRunsStartsItsOwnAtTheFirstCommit(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	b := newBroker(t, "mail.send")
	relay := newRelay(t, pool, b.pub, pgoutbox.RelayConfig{PollInterval: time.Hour, ProbeInterval: -1})
	ctx := runRelay(t, relay)
	ob := pipelinetest.Outbox(t)
	waker := pgoutbox.NewWaker(pool, pgoutbox.WakerConfig{})
	ob.SetWaker(waker)
	defer waker.Close()
	waitAsleep(t, relay)

	require.NoError(t, ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
		return p.PublishEvents(ctx, pipeline.Outgoing{Topic: "mail.send", Msg: event(t, "u", "unrun")})
	}))
	start := time.Now()
	require.Eventually(t, func() bool { return relay.Stats().Dispatched == 1 }, 5*time.Second, time.Millisecond)
	require.Less(t, time.Since(start), 2*time.Second, "woken at the commit")
	require.Eventually(t, func() bool { return waker.Sent() == 1 }, time.Second, time.Millisecond)

	waker.Close()
	ob.Committed()
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, int64(1), waker.Sent(), "closed, it starts nothing")
}

// waitAsleep waits until relay (its poll an hour, no probe) has claimed,
// found nothing and sleeps: a row committed from then on is found only by
// a wake-up. Two claims: its listener wakes it once when LISTEN takes
// effect (for rows committed before), and on a loaded machine that wake
// can come after the first claim; the second claim is the one it makes
// for it. Then quiet: no claim for half a second (a start-up wake-up late
// on a loaded machine once came after the second claim).
func waitAsleep(t *testing.T, relay *pgoutbox.Relay) {
	t.Helper()
	require.Eventually(t, func() bool { return relay.Stats().Claims >= 2 }, 10*time.Second, time.Millisecond)
	last, quietSince := relay.Stats().Claims, time.Now()
	require.Eventually(t, func() bool {
		if c := relay.Stats().Claims; c != last {
			last, quietSince = c, time.Now()
		}
		return time.Since(quietSince) >= 500*time.Millisecond
	}, 10*time.Second, 5*time.Millisecond)
}

// runRelay runs relay until the test ends (its cleanups run before those
// registered earlier, the schema's drop among them); ctx is the run's.
func runRelay(t *testing.T, relay *pgoutbox.Relay) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return ctx
}
