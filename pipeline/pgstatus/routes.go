package pgstatus

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RoutesTable is the route registry (migration 00031).
const RoutesTable = "ferry_routes"

// Route is a route as the consumers that run it registered it.
type Route struct {
	Route   string `json:"route"`
	Topic   string `json:"topic"`
	Ordered bool   `json:"ordered"`
	// Partitions is the number of partition queues of an ordered route
	// (FERRY_AMQP_PARTITIONS when it started), 1 otherwise.
	Partitions int       `json:"partitions"`
	SeenAt     time.Time `json:"seen_at"`
}

// RegisterRoutes records the routes a consumer process starts with, so
// that tools without the route table know which topic each consumes. A
// route that left the table keeps its row: the row only maps a name to a
// topic, and what waits is told by pauses and holds, which are fresh by
// themselves.
func RegisterRoutes(ctx context.Context, pool *pgxpool.Pool, routes []Route) error {
	if len(routes) == 0 {
		return nil
	}
	names, topics, ordered, partitions := make([]string, len(routes)), make([]string, len(routes)), make([]bool, len(routes)), make([]int32, len(routes))
	for i, r := range routes {
		names[i], topics[i], ordered[i], partitions[i] = r.Route, r.Topic, r.Ordered, int32(max(r.Partitions, 1))
	}
	_, err := pool.Exec(ctx, `INSERT INTO `+RoutesTable+` (route, topic, ordered, partitions)
		SELECT * FROM unnest($1::text[], $2::text[], $3::boolean[], $4::int[])
		ON CONFLICT (route) DO UPDATE SET topic = excluded.topic, ordered = excluded.ordered, partitions = excluded.partitions, seen_at = now()`,
		names, topics, ordered, partitions)
	if err != nil {
		return fmt.Errorf("registering the route table: %w", err)
	}
	return nil
}

// Reader is a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Routes returns the registered routes, by name.
func Routes(ctx context.Context, q Reader) ([]Route, error) {
	rows, err := q.Query(ctx, `SELECT route, topic, ordered, partitions, seen_at FROM `+RoutesTable+` ORDER BY route`)
	if err != nil {
		return nil, fmt.Errorf("reading the route registry: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Route])
}
