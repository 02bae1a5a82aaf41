package pgoutbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/internal/republish"
)

// Rescheduler writes durable retries into the outbox on pipeline.RetryTopic
// with available_at pushed out by their delay: the relay delivers them when
// due, to the queue named in their headers. Durable retries are outbox rows
// rather than RabbitMQ TTL queues because the outbox already is a durable
// schedule (backoff, delays, attempts, last_error, metrics, status), so a
// waiting retry is visible, survives restarts and blocks no queue, with no
// per-delay queues to declare.
type Rescheduler struct {
	pool   *pgxpool.Pool
	outbox *Outbox
}

// NewRescheduler returns a Rescheduler writing through outbox (the one
// INSERT path) on pool.
func NewRescheduler(pool *pgxpool.Pool, outbox *Outbox) (*Rescheduler, error) {
	if pool == nil || outbox == nil {
		return nil, errors.New("pgoutbox: NewRescheduler needs a pool and an outbox")
	}
	return &Rescheduler{pool: pool, outbox: outbox}, nil
}

// ScheduleRetry implements the durable retry link's RetryScheduler. The
// retry keeps the message's id as its UUID: it is the same message.
func (r *Rescheduler) ScheduleRetry(ctx context.Context, rt pipeline.Retry) error {
	if rt.Headers[pipeline.MetaRetryQueue] == "" {
		return errors.New("retry has no queue to go back to")
	}
	id := rt.Headers[pipeline.MetaMessageID]
	if id == "" {
		return errors.New("retry has no message id")
	}
	msg := message.NewMessage(id, rt.Payload)
	for k, v := range rt.Headers {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(pipeline.MetaAggregateID, rt.AggregateID)
	pipeline.WithDelay(msg, rt.Delay)
	if err := r.outbox.PublishTx(republish.Context(ctx), PgxTx(r.pool), pipeline.RetryTopic, msg); err != nil {
		err = fmt.Errorf("writing retry into the outbox: %w", err)
		if errors.Is(err, pipeline.ErrInvalidEvent) {
			return err // the message's own fault: it goes to the poison store with the reason
		}
		// Anything else is the outbox's database failing to take a valid
		// row: the message waits, it is not poisoned.
		return pipeline.Infrastructure(err)
	}
	return nil
}
