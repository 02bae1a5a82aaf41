package pipelinetest

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// OutboxRow is a row a test writes into the outbox as a producer, a relay
// or an operator would have left it, without writing SQL over the outbox
// itself: the table comes from a pgoutbox.Table (OutboxTable), so the
// suites pass with the outbox renamed. A zero field takes the column's
// default.
type OutboxRow struct {
	MessageUUID string
	AggregateID string
	Topic       string
	// Payload is JSON. Default {}.
	Payload string
	Headers map[string]string
	// AvailableAt delays the row (or, with Attempts, is its backoff).
	AvailableAt time.Time
	CreatedAt   time.Time
	Attempts    int
	LastError   string
	// Slow puts the row in the slow lane (a failed, delayed or held row's
	// state, as the relay leaves it).
	Slow bool
	// Dispatched marks the row dispatched (at DispatchedAt, else now), as
	// the slow lane does.
	Dispatched   bool
	DispatchedAt time.Time
	Shadowed     bool
	// Part, if set, is the row's weekly partition (pgweeks); default the
	// week of CreatedAt (now if unset).
	Part *int
}

// OutboxTable is the outbox table of the test's schema (see
// ferrytest.OutboxTable).
func OutboxTable(t testing.TB) pgoutbox.Table {
	t.Helper()
	tbl, err := ferrytest.OutboxTable()
	if err != nil {
		t.Fatal(err)
	}
	return tbl
}

// RowWriter is what InsertOutbox writes with: a pool, a connection or a
// transaction.
type RowWriter interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// InsertOutbox writes rows into tbl and returns their ids, in order.
func InsertOutbox(t testing.TB, q RowWriter, tbl pgoutbox.Table, rows ...OutboxRow) []int64 {
	t.Helper()
	ids := make([]int64, len(rows))
	for i, r := range rows {
		var headers []byte
		if r.Headers != nil {
			var err error
			if headers, err = json.Marshal(r.Headers); err != nil {
				t.Fatal(err)
			}
		}
		payload := r.Payload
		if payload == "" {
			payload = "{}"
		}
		var dispatchedAt *time.Time
		if r.Dispatched {
			at := r.DispatchedAt
			if at.IsZero() {
				at = time.Now()
			}
			dispatchedAt = &at
		}
		err := q.QueryRow(context.Background(), `INSERT INTO `+tbl.Quoted()+`
			(message_uuid, aggregate_id, topic, payload, headers, available_at, created_at, attempts, last_error, slow, dispatched_at, shadowed, part)
			VALUES (nullif($1, ''), $2, $3, $4::jsonb, coalesce($5::jsonb, '{}'), coalesce($6, now()), coalesce($7, now()), $8, nullif($9, ''), $10, $11, $12,
			        coalesce($13, ferry_outbox_part(coalesce($7, now()))))
			RETURNING id`,
			r.MessageUUID, r.AggregateID, r.Topic, payload, headers, timeOrNil(r.AvailableAt), timeOrNil(r.CreatedAt), r.Attempts, r.LastError,
			r.Slow, dispatchedAt, r.Shadowed, r.Part).Scan(&ids[i])
		if err != nil {
			t.Fatalf("pipelinetest.InsertOutbox: row %d: %v", i, err)
		}
	}
	return ids
}

func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// RequireDefaultOutbox skips a test of Ferry's own migrations, which make
// and change the table "outbox", when the suite runs with the outbox
// renamed (FERRY_TEST_OUTBOX_TABLE); it runs in the suite under the
// default name, which CI runs too.
func RequireDefaultOutbox(t testing.TB) {
	t.Helper()
	if OutboxTable(t).Name() != pgoutbox.DefaultTable {
		t.Skipf("migrates the table %q itself: run without FERRY_TEST_OUTBOX_TABLE", pgoutbox.DefaultTable)
	}
}
