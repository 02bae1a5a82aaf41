package pgoutbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
)

// Rescheduler writes durable retries into the outbox on pipeline.RetryTopic
// with available_at pushed out by their delay: the relay delivers them when
// due, to the queue named in their headers. Durable retries are outbox rows
// rather than RabbitMQ TTL queues because the outbox already is a durable
// schedule (backoff, delays, attempts, last_error, metrics, status), so a
// waiting retry is visible, survives restarts and blocks no queue, with no
// per-delay queues to declare.
type Rescheduler struct {
	pool      *pgxpool.Pool
	insertSQL string
}

// NewRescheduler returns a Rescheduler writing to pool's outbox (table, default "outbox").
func NewRescheduler(pool *pgxpool.Pool, table string) (*Rescheduler, error) {
	if pool == nil {
		return nil, errors.New("pgoutbox: NewRescheduler needs a pool")
	}
	if table == "" {
		table = "outbox"
	}
	return &Rescheduler{pool: pool, insertSQL: `INSERT INTO ` + pgx.Identifier{table}.Sanitize() +
		` (aggregate_id, topic, payload, headers, available_at) VALUES ($1, $2, $3::jsonb, $4, now() + $5 * interval '1 microsecond')`}, nil
}

// ScheduleRetry implements the durable retry link's RetryScheduler.
func (r *Rescheduler) ScheduleRetry(ctx context.Context, rt pipeline.Retry) error {
	if !json.Valid(rt.Payload) {
		return errors.New("payload is not JSON: it cannot be stored in the outbox for a retry")
	}
	if rt.Headers[pipeline.MetaRetryQueue] == "" {
		return errors.New("retry has no queue to go back to")
	}
	if _, err := r.pool.Exec(ctx, r.insertSQL, rt.AggregateID, pipeline.RetryTopic, string(rt.Payload), rt.Headers, rt.Delay.Microseconds()); err != nil {
		return fmt.Errorf("writing retry into the outbox: %w", err)
	}
	return nil
}
