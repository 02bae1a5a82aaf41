package pipelinetest

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// PoisonRow is a message a test puts in the poison store as a consumer
// that gave up on it would have left it, without writing SQL over the
// store's table. A zero field takes the column's default; Topic, Handler
// and Reason default to "t", "h" and "failed", Payload to {}.
type PoisonRow struct {
	MessageID     string
	Topic         string
	Handler       string
	AggregateID   string
	Payload       string
	Headers       map[string]string
	Reason        string
	CorrelationID string
	Permanent     bool
	Attempts      int
	// PoisonedAt, if set, is when it was poisoned (and first and last
	// failed); default now.
	PoisonedAt time.Time
}

// InsertPoison writes rows into the poison store and returns their ids, in
// order. A row without MessageID gets "m<i>" (its index in rows).
func InsertPoison(t testing.TB, q RowWriter, rows ...PoisonRow) []int64 {
	t.Helper()
	ids := make([]int64, len(rows))
	for i, r := range rows {
		headers := []byte("{}")
		if r.Headers != nil {
			var err error
			if headers, err = json.Marshal(r.Headers); err != nil {
				t.Fatal(err)
			}
		}
		r.MessageID = or(r.MessageID, "m"+strconv.Itoa(i))
		attempts := r.Attempts
		if attempts == 0 {
			attempts = 1
		}
		err := q.QueryRow(context.Background(), `INSERT INTO `+pgpoison.Table+`
			(message_id, topic, handler, aggregate_id, payload, headers, reason, correlation_id, permanent, attempts,
			 first_failed_at, last_failed_at, poisoned_at)
			VALUES ($1, $2, $3, $4, convert_to($5, 'UTF8'), $6::jsonb, $7, $8, $9, $10,
			        coalesce($11, now()), coalesce($11, now()), coalesce($11, now()))
			RETURNING id`,
			r.MessageID, or(r.Topic, "t"), or(r.Handler, "h"), r.AggregateID, or(r.Payload, "{}"), headers,
			or(r.Reason, "failed"), r.CorrelationID, r.Permanent, attempts, timeOrNil(r.PoisonedAt)).Scan(&ids[i])
		if err != nil {
			t.Fatalf("pipelinetest.InsertPoison: row %d: %v", i, err)
		}
	}
	return ids
}

// Poisoned returns what the poison store holds that f chooses, oldest
// first, as the store reads it.
func Poisoned(t testing.TB, pool *pgxpool.Pool, f pgpoison.Filter) []pgpoison.Record {
	t.Helper()
	store, err := pgpoison.NewStore(pool, Outbox(t))
	if err != nil {
		t.Fatal(err)
	}
	var out []pgpoison.Record
	if err := store.Each(context.Background(), f, func(r pgpoison.Record) error {
		out = append(out, r)
		return nil
	}); err != nil {
		t.Fatalf("pipelinetest.Poisoned: %v", err)
	}
	return out
}

// PoisonIDs is the ids of Poisoned(t, pool, f), oldest first.
func PoisonIDs(t testing.TB, pool *pgxpool.Pool, f pgpoison.Filter) []int64 {
	t.Helper()
	var ids []int64
	for _, r := range Poisoned(t, pool, f) {
		ids = append(ids, r.ID)
	}
	return ids
}

// CountPoisoned is how many messages f chooses in the poison store.
func CountPoisoned(t testing.TB, pool *pgxpool.Pool, f pgpoison.Filter) int {
	t.Helper()
	return len(Poisoned(t, pool, f))
}

// Audited returns the audit log's entries of action ("" for all), oldest
// first.
func Audited(t testing.TB, pool *pgxpool.Pool, action string) []pgaudit.Entry {
	t.Helper()
	all, err := pgaudit.List(context.Background(), pool, 10_000)
	if err != nil {
		t.Fatalf("pipelinetest.Audited: %v", err)
	}
	var out []pgaudit.Entry
	for i := len(all) - 1; i >= 0; i-- {
		if action == "" || all[i].Action == action {
			out = append(out, all[i])
		}
	}
	return out
}

func or(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
