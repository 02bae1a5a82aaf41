package pipelinetest

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RoundTrips counts what the connections of a CountingPool send: each
// query and each batch is one network round trip. It is how a test proves
// a write shares a round trip with another instead of timing it. pgx
// prepares a statement once per connection before its first use (a round
// trip it does not trace), so warm a path up before counting it.
type RoundTrips struct {
	mu      sync.Mutex
	queries []string
	batches int
}

// TraceQueryStart implements pgx.QueryTracer.
func (r *RoundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.queries = append(r.queries, d.SQL)
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (r *RoundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart implements pgx.BatchTracer.
func (r *RoundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.batches++
	return ctx
}

// TraceBatchQuery implements pgx.BatchTracer.
func (r *RoundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

// TraceBatchEnd implements pgx.BatchTracer.
func (r *RoundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// Take returns the queries (their SQL) and the number of batches sent
// since the last Take, and starts counting afresh.
func (r *RoundTrips) Take() (queries []string, batches int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	queries, batches = r.queries, r.batches
	r.queries, r.batches = nil, 0
	return
}

// CountingPool is a pool on pool's database and schema, of one connection
// (so a count is never split between two), whose round trips rt counts.
// It is closed when the test ends.
func CountingPool(t testing.TB, pool *pgxpool.Pool) (counted *pgxpool.Pool, rt *RoundTrips) {
	t.Helper()
	cfg := pool.Config()
	cfg.MaxConns, cfg.MinConns = 1, 0
	rt = &RoundTrips{}
	cfg.ConnConfig.Tracer = rt
	counted, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("opening a counting pool: %v", err)
	}
	t.Cleanup(counted.Close)
	return counted, rt
}
