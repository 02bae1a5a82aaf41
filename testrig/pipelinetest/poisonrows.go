package pipelinetest

import (
	"context"
	"encoding/json"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// InsertPoison writes rows into the poison store, in one statement, and
// returns their ids, in order. A row without MessageID gets "m<i>" (its
// index in rows).
func InsertPoison(t testing.TB, q RowQuerier, rows ...PoisonRow) []int64 {
	t.Helper()
	n := len(rows)
	var (
		messageIDs, topics, handlers, aggregates = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		payloads, headers, reasons, correlations = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		permanent                                = make([]bool, n)
		attempts                                 = make([]int, n)
		at                                       = make([]*time.Time, n)
	)
	for i, r := range rows {
		h := []byte("{}")
		if r.Headers != nil {
			var err error
			if h, err = json.Marshal(r.Headers); err != nil {
				t.Fatal(err)
			}
		}
		messageIDs[i], topics[i], handlers[i], aggregates[i] = or(r.MessageID, "m"+strconv.Itoa(i)), or(r.Topic, "t"), or(r.Handler, "h"), r.AggregateID
		payloads[i], headers[i], reasons[i], correlations[i] = or(r.Payload, "{}"), string(h), or(r.Reason, "failed"), r.CorrelationID
		permanent[i], attempts[i], at[i] = r.Permanent, max(r.Attempts, 1), timeOrNil(r.PoisonedAt)
	}
	res, err := q.Query(context.Background(), `INSERT INTO `+pgpoison.Table+`
			(message_id, topic, handler, aggregate_id, payload, headers, reason, correlation_id, permanent, attempts,
			 first_failed_at, last_failed_at, poisoned_at)
		SELECT m, tp, h, a, convert_to(p, 'UTF8'), hd::jsonb, r, c, pm, n, coalesce(at, now()), coalesce(at, now()), coalesce(at, now())
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::bool[], $10::int[], $11::timestamptz[])
		     WITH ORDINALITY AS x(m, tp, h, a, p, hd, r, c, pm, n, at, i)
		ORDER BY i
		RETURNING id`,
		messageIDs, topics, handlers, aggregates, payloads, headers, reasons, correlations, permanent, attempts, at)
	if err != nil {
		t.Fatalf("pipelinetest.InsertPoison: %v", err)
	}
	ids, err := pgx.CollectRows(res, pgx.RowTo[int64])
	if err != nil {
		t.Fatalf("pipelinetest.InsertPoison: %v", err)
	}
	// Ids come from the sequence in the SELECT's order; sorted, they are
	// the rows' in order whatever order RETURNING gives them back in.
	slices.Sort(ids)
	return ids
}

// RowQuerier is what InsertPoison writes with: a pool, a connection or a
// transaction.
type RowQuerier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
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
