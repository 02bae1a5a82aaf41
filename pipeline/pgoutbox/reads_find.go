package pgoutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
)

// Row is one outbox row as the operators' reads show it: one column list
// (rowColumns) and one scan (scanRow) for every read that returns rows.
type Row struct {
	ID int64
	// MessageID is the message's id (its UUID; the row id for rows
	// written before migration 00009).
	MessageID   string
	AggregateID string
	Topic       string
	Headers     map[string]string
	CreatedAt   time.Time
	AvailableAt time.Time
	// DispatchedAt is set when a lane marked the row; a row the
	// append-only lane's position passed has none.
	DispatchedAt *time.Time
	// Dispatched: marked, or passed by the position.
	Dispatched bool
	Attempts   int
	LastError  string
	// Shadowed: a shadow intent the relay marked dispatched without
	// publishing it (adoption/shadow).
	Shadowed bool
	// Payload is the bytes as published (payload_raw, or the jsonb as
	// text), read only by the reads that say so (Operator.Row).
	Payload []byte
}

// rowColumns are Row's columns of outbox row o; done is the expression of
// Dispatched; payload adds the payload (scanRowPayload).
func rowColumns(done string, payload bool) string {
	return rowColumnsCounting(done, `o.attempts`, payload)
}

// rowColumnsCounting is rowColumns with attempts the expression of
// Attempts.
func rowColumnsCounting(done, attempts string, payload bool) string {
	cols := `o.id, coalesce(o.message_uuid, o.id::text), o.aggregate_id, o.topic, o.headers, o.created_at, o.available_at, o.dispatched_at, ` +
		done + `, ` + attempts + `, coalesce(o.last_error, ''), o.shadowed`
	if payload {
		cols += `, COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8'))`
	}
	return cols
}

func (r *Row) fields(headers *map[string]any) []any {
	return []any{&r.ID, &r.MessageID, &r.AggregateID, &r.Topic, headers, &r.CreatedAt, &r.AvailableAt, &r.DispatchedAt, &r.Dispatched, &r.Attempts, &r.LastError, &r.Shadowed}
}

// setHeaders keeps the headers as the relay publishes them: strings as
// they are, anything else (written by hand, say) as its JSON text.
func (r *Row) setHeaders(h map[string]any) {
	r.Headers = make(map[string]string, len(h))
	for k, v := range h {
		r.Headers[k] = headerValue(v)
	}
}

func scanRow(row pgx.CollectableRow) (Row, error) {
	var r Row
	var h map[string]any
	err := row.Scan(r.fields(&h)...)
	r.setHeaders(h)
	return r, err
}

func scanRowPayload(row pgx.CollectableRow) (Row, error) {
	var r Row
	var h map[string]any
	err := row.Scan(append(r.fields(&h), &r.Payload)...)
	r.setHeaders(h)
	return r, err
}

// Find returns, newest first, at most limit rows of the outbox (or, with
// archived, of its archive, whose rows are all dispatched) whose message
// id, aggregate id, correlation id or original message id (a durable
// retry's) is id. Each key has an index (migration 00032: the last a
// partial one, over the rows that carry it, which is why the condition
// names the key), so the OR is a BitmapOr; the caller bounds it anyway (a
// read-only transaction with a statement timeout).
func (t Table) Find(ctx context.Context, q Reader, archived bool, id string, limit int) ([]Row, error) {
	rel, done := t.Quoted(), t.dispatchedCond("o")
	if archived {
		rel, done = t.Archive(), "true"
	}
	rows, err := q.Query(ctx, `SELECT `+rowColumns(done, false)+`
		FROM `+rel+` o WHERE o.message_uuid = $1 OR o.aggregate_id = $1 OR o.headers->>'`+pipeline.MetaCorrelationID+`' = $1 OR (o.headers ? '`+pipeline.MetaMessageID+`' AND o.headers->>'`+pipeline.MetaMessageID+`' = $1)
		ORDER BY o.id DESC LIMIT $2`, id, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scanRow)
}

// Intents returns the events (durable retries aside) of one aggregate
// (aggregateID) or, without one, those with these message ids, oldest
// first, at most limit. A row the relay sent at its first try keeps no
// attempt count of its own (it was passed, not marked): its one attempt
// is counted here.
func (t Table) Intents(ctx context.Context, q Reader, aggregateID string, ids []string, limit int) ([]Row, error) {
	done := t.dispatchedCond("o")
	attempts := `CASE WHEN o.dispatched_at IS NULL AND o.attempts = 0 AND ` + done + ` THEN 1 ELSE o.attempts END`
	rows, err := q.Query(ctx, `SELECT `+rowColumnsCounting(done, attempts, false)+`
		FROM `+t.Quoted()+` o WHERE o.topic <> @retry_topic
		  AND (CASE WHEN @aggregate <> '' THEN o.aggregate_id = @aggregate ELSE o.message_uuid = ANY(@ids) END)
		ORDER BY o.id LIMIT @limit`,
		pgx.NamedArgs{"retry_topic": pipeline.RetryTopic, "aggregate": aggregateID, "ids": ids, "limit": limit})
	if err != nil {
		return nil, fmt.Errorf("reading intents: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanRow)
	if err != nil {
		return nil, fmt.Errorf("reading intents: %w", err)
	}
	return out, nil
}

// SentMessageIDs returns, in id order, the message ids of topic's
// dispatched rows as consumers key their ledger by them: a durable retry's
// or requeue's original id (pipeline.MetaMessageID), else the row's UUID,
// else its id. For tests and tools that ask whether every sent message was
// handled (pgledger's Unprocessed, pgpoison's NotPoisoned).
func (t Table) SentMessageIDs(ctx context.Context, q Reader, topic string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT coalesce(o.headers->>'`+pipeline.MetaMessageID+`', o.message_uuid, o.id::text)
		FROM `+t.View(StateDispatched)+` o WHERE o.topic = $1 ORDER BY o.id`, topic)
	if err != nil {
		return nil, fmt.Errorf("reading the message ids sent on %s: %w", topic, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// WaitingRetries returns the durable retries still pending of the
// messages with these ids (the retry row carries the original message's
// id as its own), in id order.
func (t Table) WaitingRetries(ctx context.Context, q Reader, ids []string) ([]Row, error) {
	rows, err := q.Query(ctx, `SELECT `+rowColumns("false", false)+` FROM `+t.Quoted()+` o
		WHERE o.topic = $1 AND o.message_uuid = ANY($2) AND NOT `+t.dispatchedCond("o")+` ORDER BY o.id`, pipeline.RetryTopic, ids)
	if err != nil {
		return nil, fmt.Errorf("reading durable retries: %w", err)
	}
	return pgx.CollectRows(rows, scanRow)
}

// ShadowSides compares, for one topic, the aggregates with shadow intents
// with those of the legacy system's effects.
type ShadowSides struct {
	Topic                string   `json:"topic"`
	Intents              int      `json:"intents"`
	LegacyEffects        int      `json:"legacy_effects"`
	Matched              int      `json:"matched"`
	MissingInOutbox      []string `json:"missing_in_outbox"`
	MissingInOutboxCount int      `json:"missing_in_outbox_count"`
	MissingInLegacy      []string `json:"missing_in_legacy"`
	MissingInLegacyCount int      `json:"missing_in_legacy_count"`
}

// CompareShadow compares, per topic, the aggregates with shadow intents in
// the outbox against those the legacy system recorded in legacy (a quoted
// relation of the caller's with topic, aggregate_id and recorded_at)
// since the given time, in one pass inside the database (the sets
// themselves stay there); sample bounds the aggregate ids listed per side.
func (t Table) CompareShadow(ctx context.Context, q Reader, legacy string, since time.Time, topic string, shadowTopics []string, sample int) ([]ShadowSides, error) {
	rows, err := q.Query(ctx, `
		WITH intents AS (
			SELECT DISTINCT topic, aggregate_id FROM `+t.Quoted()+`
			WHERE created_at >= @since AND (@topic = '' OR topic = @topic) AND topic <> @retry_topic
			  AND (shadowed OR headers->>'`+pipeline.MetaShadow+`' = 'true' OR topic = ANY(@shadow_topics))),
		legacy AS (
			SELECT DISTINCT topic, aggregate_id FROM `+legacy+`
			WHERE recorded_at >= @since AND (@topic = '' OR topic = @topic)),
		joined AS (
			SELECT coalesce(i.topic, l.topic) AS topic, coalesce(i.aggregate_id, l.aggregate_id) AS aggregate_id,
			       i.topic IS NOT NULL AS has_intent, l.topic IS NOT NULL AS has_legacy
			FROM intents i FULL JOIN legacy l ON i.topic = l.topic AND i.aggregate_id = l.aggregate_id)
		SELECT topic,
		       count(*) FILTER (WHERE has_intent), count(*) FILTER (WHERE has_legacy),
		       count(*) FILTER (WHERE has_intent AND has_legacy),
		       coalesce((array_agg(aggregate_id ORDER BY aggregate_id) FILTER (WHERE has_legacy AND NOT has_intent))[1:@sample], '{}'),
		       count(*) FILTER (WHERE has_legacy AND NOT has_intent),
		       coalesce((array_agg(aggregate_id ORDER BY aggregate_id) FILTER (WHERE has_intent AND NOT has_legacy))[1:@sample], '{}'),
		       count(*) FILTER (WHERE has_intent AND NOT has_legacy)
		FROM joined GROUP BY topic ORDER BY topic`,
		pgx.NamedArgs{"since": since, "topic": topic, "shadow_topics": shadowTopics, "retry_topic": pipeline.RetryTopic, "sample": sample})
	if err != nil {
		return nil, fmt.Errorf("comparing shadow intents with legacy effects: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[ShadowSides])
}

// RowFilter chooses the rows Rows returns; an empty field chooses all.
type RowFilter struct {
	IDs []int64
	// MessageID chooses the row of one message (its UUID).
	MessageID   string
	Topic       string
	AggregateID string
	// Pending, if set, keeps only rows not dispatched (true) or only those
	// dispatched (false).
	Pending *bool
}

// Rows returns the rows f chooses, in id order, with whether each was
// dispatched: for tools and tests that look at a handful of rows (each
// row's state is looked up per row).
func (t Table) Rows(ctx context.Context, q Reader, f RowFilter) ([]Row, error) {
	done := t.dispatchedCond("o")
	rows, err := q.Query(ctx, `SELECT `+rowColumns(done, true)+` FROM `+t.Quoted()+` o
		WHERE (coalesce(cardinality(@ids::bigint[]), 0) = 0 OR o.id = ANY(@ids)) AND (@topic = '' OR o.topic = @topic)
		  AND (@aggregate = '' OR o.aggregate_id = @aggregate)
		  AND (@pending::bool IS NULL OR @pending <> (`+done+`)) AND (@message = '' OR o.message_uuid = @message)
		ORDER BY o.id`,
		pgx.NamedArgs{"ids": f.IDs, "topic": f.Topic, "aggregate": f.AggregateID, "pending": f.Pending, "message": f.MessageID})
	if err != nil {
		return nil, fmt.Errorf("reading outbox rows: %w", err)
	}
	return pgx.CollectRows(rows, scanRowPayload)
}
