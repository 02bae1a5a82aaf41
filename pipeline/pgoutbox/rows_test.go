package pgoutbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// The suite's one reader and writer of outbox rows by a condition. The
// table (renamed in CI's second run) and the dispatched rule are named
// here once; a test says only what it asks of the rows, in a condition
// over the alias o.

// querier is a pool, a connection or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// outboxRow is one row as producers and relays left it.
type outboxRow struct {
	ID           int64
	MessageUUID  string
	AggregateID  string
	Topic        string
	Attempts     int
	LastError    string
	CreatedAt    time.Time
	AvailableAt  time.Time
	DueAt        *time.Time
	DispatchedAt *time.Time
	// Dispatched is the table's rule: marked, or passed by the position.
	Dispatched bool
	Slow       bool
	Shadowed   bool
	// Partition is the row's weekly partition (regclass text).
	Partition string
	Headers   map[string]any
	// Payload is the jsonb payload as text ("" when stored raw), Raw the
	// bytes kept when it is not jsonb.
	Payload string
	Raw     []byte
}

func where(cond string) string {
	if cond == "" {
		return ""
	}
	return ` WHERE ` + cond
}

// rowsWhere reads the rows matching cond, in id order.
func rowsWhere(t testing.TB, q querier, cond string, args ...any) []outboxRow {
	t.Helper()
	rows, err := q.Query(context.Background(), `SELECT o.id, coalesce(o.message_uuid, ''), o.aggregate_id, o.topic, o.attempts,
		coalesce(o.last_error, ''), o.created_at, o.available_at, o.due_at, o.dispatched_at, `+pgoutbox.DispatchedOutbox+`,
		o.slow, o.shadowed, o.tableoid::regclass::text, o.headers, coalesce(o.payload::text, ''), o.payload_raw
		FROM `+outboxSQL+` o`+where(cond)+` ORDER BY o.id`, args...)
	if err != nil {
		t.Fatalf("reading outbox rows where %q: %v", cond, err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outboxRow, error) {
		var o outboxRow
		err := r.Scan(&o.ID, &o.MessageUUID, &o.AggregateID, &o.Topic, &o.Attempts, &o.LastError, &o.CreatedAt, &o.AvailableAt,
			&o.DueAt, &o.DispatchedAt, &o.Dispatched, &o.Slow, &o.Shadowed, &o.Partition, &o.Headers, &o.Payload, &o.Raw)
		return o, err
	})
	if err != nil {
		t.Fatalf("reading outbox rows where %q: %v", cond, err)
	}
	return got
}

// rowWhere reads the one row matching cond.
func rowWhere(t testing.TB, q querier, cond string, args ...any) outboxRow {
	t.Helper()
	got := rowsWhere(t, q, cond, args...)
	if len(got) != 1 {
		t.Fatalf("want one outbox row where %q, got %d", cond, len(got))
	}
	return got[0]
}

// countWhere counts the rows matching cond ("" counts all).
func countWhere(t testing.TB, q querier, cond string, args ...any) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), `SELECT count(*) FROM `+outboxSQL+` o`+where(cond), args...).Scan(&n); err != nil {
		t.Fatalf("counting outbox rows where %q: %v", cond, err)
	}
	return n
}

// countPending counts the pending rows (the relay's own read of them)
// matching cond.
func countPending(t testing.TB, q querier, cond string, args ...any) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), `SELECT count(*) FROM `+pgoutbox.PendingOutbox+` o`+where(cond), args...).Scan(&n); err != nil {
		t.Fatalf("counting pending outbox rows where %q: %v", cond, err)
	}
	return n
}

// updateWhere sets columns of the rows matching cond, as an operator or a
// test's clock would, and returns how many it changed.
func updateWhere(t testing.TB, q querier, set, cond string, args ...any) int64 {
	t.Helper()
	tag, err := q.Exec(context.Background(), `UPDATE `+outboxSQL+` o SET `+set+where(cond), args...)
	if err != nil {
		t.Fatalf("updating outbox rows where %q: %v", cond, err)
	}
	return tag.RowsAffected()
}

// lockRows takes the row locks of the rows matching cond in tx, as a
// relay that claimed them holds them.
func lockRows(t testing.TB, tx querier, cond string, args ...any) {
	t.Helper()
	if _, err := tx.Exec(context.Background(), `SELECT 1 FROM `+outboxSQL+` o`+where(cond)+` FOR UPDATE`, args...); err != nil {
		t.Fatalf("locking outbox rows where %q: %v", cond, err)
	}
}

// insertBulk writes n rows of topic in one statement, aggregate 'a' || g
// (g mod aggregates when aggregates > 0), marked dispatched if dispatched,
// and returns the first one's id.
func insertBulk(t testing.TB, q querier, n, aggregates int, topic string, dispatched bool) int64 {
	t.Helper()
	var first int64
	err := q.QueryRow(context.Background(), `WITH ins AS (
		INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, dispatched_at)
		SELECT 'a' || CASE WHEN $2::int > 0 THEN g % $2::int ELSE g END, $3, '{}', CASE WHEN $4 THEN now() END
		FROM generate_series(1, $1::int) g RETURNING id)
		SELECT min(id) FROM ins`, n, aggregates, topic, dispatched).Scan(&first)
	if err != nil {
		t.Fatalf("inserting %d outbox rows: %v", n, err)
	}
	return first
}

// insertAtTx writes a row whose tx is given (an expression over $1 and
// more args), as a row restored from another cluster's dump or written
// beside a position a test placed carries it.
func insertAtTx(t testing.TB, q querier, messageUUID, aggregate, topic, txExpr string, args ...any) {
	t.Helper()
	if _, err := q.Exec(context.Background(), `INSERT INTO `+outboxSQL+` (message_uuid, aggregate_id, topic, payload, tx)
		VALUES (nullif('`+messageUUID+`', ''), '`+aggregate+`', '`+topic+`', '{}', (`+txExpr+`)::text::xid8)`, args...); err != nil {
		t.Fatalf("inserting outbox row at tx %s: %v", txExpr, err)
	}
}

// pendingSelect is a read of the pending rows (alias o): cols, then tail
// (a WHERE, a GROUP BY), for plans and counts.
func pendingSelect(cols, tail string) string {
	return `SELECT ` + cols + ` FROM ` + pgoutbox.PendingOutbox + ` o ` + tail
}

// explain is q's plan for statement.
func explain(t testing.TB, q querier, statement string, args ...any) string {
	t.Helper()
	rows, err := q.Query(context.Background(), "EXPLAIN "+statement, args...)
	if err != nil {
		t.Fatalf("explaining %s: %v", statement, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("explaining %s: %v", statement, err)
	}
	return strings.Join(lines, "\n")
}

// analyze refreshes the outbox's planner statistics.
func analyze(t testing.TB, q querier) {
	t.Helper()
	if _, err := q.Exec(context.Background(), `ANALYZE `+outboxSQL); err != nil {
		t.Fatalf("analyze: %v", err)
	}
}

// placePosition writes a position of the relay over the test table, as a
// move does, at a snapshot (an expression: pg_current_snapshot() or a
// parameter).
func placePosition(t testing.TB, q querier, snapExpr string, args ...any) {
	t.Helper()
	if _, err := q.Exec(context.Background(), `INSERT INTO `+pgoutbox.PositionTable+` (outbox_table, snap) VALUES ('`+testTable.Key()+`', `+snapExpr+`)`, args...); err != nil {
		t.Fatalf("placing the relay's position: %v", err)
	}
}

// passBatch writes the position of a batch in progress that passed the
// rows up to the skip+1-th in (tx, id) order, under the latest position's
// snapshot, as a move inside a batch writes it.
func passBatch(t testing.TB, q querier, skip int) {
	t.Helper()
	_, err := q.Exec(context.Background(), `INSERT INTO `+pgoutbox.PositionTable+` (outbox_table, snap, cur, last_tx, last_id)
		SELECT $1, p.snap, pg_current_snapshot(), last.tx, last.id
		FROM (SELECT snap FROM `+pgoutbox.PositionTable+` WHERE outbox_table = $1 ORDER BY seq DESC LIMIT 1) p,
		     (SELECT tx, id FROM `+outboxSQL+` ORDER BY tx, id OFFSET $2 LIMIT 1) last`, testTable.Key(), skip)
	if err != nil {
		t.Fatalf("placing a batch's position: %v", err)
	}
}

// promoted moves the relay's recorded timeline one back, as if the server
// had been promoted since the relay last looked.
func promoted(t testing.TB, q querier) {
	t.Helper()
	if _, err := q.Exec(context.Background(), `UPDATE `+testTable.Timelines()+` SET timeline = timeline - 1 WHERE outbox_table = $1`, testTable.Key()); err != nil {
		t.Fatalf("moving the recorded timeline: %v", err)
	}
}
