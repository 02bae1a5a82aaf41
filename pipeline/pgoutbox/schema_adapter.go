package pgoutbox

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Limits enforced before anything is written.
const (
	// MaxAggregateIDLength keeps the per-aggregate index small.
	MaxAggregateIDLength = 512
	// MaxPayloadBytes bounds one event (pipeline.MaxPayloadBytes, the one
	// limit).
	MaxPayloadBytes = pipeline.MaxPayloadBytes
	// DefaultMaxDelay is Config.MaxDelay's default.
	DefaultMaxDelay = 365 * 24 * time.Hour
)

// ErrInsertOnly is returned by the parts of the outbox's schema adapter that watermill-sql
// would use for subscribing: the relay reads the outbox itself.
var ErrInsertOnly = errors.New("the outbox's schema adapter is insert-only: use pgoutbox.Relay to read the outbox")

// Config configures an Outbox: which table it writes, which topics need
// an aggregate id, how far ahead an event may be delayed.
type Config struct {
	// Table is the outbox table (ParseTable; InSchema qualifies it for
	// callers' transactions whose search_path is not Ferry's). Default:
	// the zero Table, "outbox" in the search_path's schema.
	Table Table
	// Ordered reports whether a topic is consumed in per-aggregate order;
	// events of such topics must carry an aggregate id. Pass the topology's
	// Ordered (rabbit.Topology.Ordered), the one home of that set. Default:
	// no topic is ordered.
	Ordered func(topic string) bool
	// MaxDelay bounds how far ahead an event may ask to be delivered
	// (pipeline.WithDelay, pipeline.WithDeliverAt): a delay of centuries is
	// a bug or an attack that would keep a row pending for ever. Default
	// DefaultMaxDelay (a year); negative: no bound.
	MaxDelay time.Duration
}

// schemaAdapter is the watermill-sql SchemaAdapter the Outbox publishes
// through: it writes Ferry's outbox table instead of watermill-sql's
// per-topic message tables. It is the one way rows get into the outbox:
// events of producers, durable retries and poison requeues all go through
// it. Unexported: it is how Outbox uses watermill-sql, not something a
// service builds.
//
// The message's UUID is stored and travels to the consumers unchanged; its
// payload is stored byte for byte (payload_raw) and, when it is JSON, also
// as jsonb (payload), so JSON events stay queryable. The metadata supplies
// the aggregate id (pipeline.MetaAggregateID: required on ordered topics,
// optional elsewhere) and the delay (pipeline.MetaDelay or
// pipeline.MetaDeliverAt); the rest of it becomes the row's headers.
//
// It creates no schema (migrations own the table), so it is safe to use
// with a transaction as the publisher's database handle.
type schemaAdapter struct {
	Config

	// republish is set on the copy Ferry's own retries and requeues write
	// through (see Outbox.PublishTx): they carry reserved metadata, and
	// their header texts are cleaned instead of refused.
	republish bool
	// quoted is Table.Quoted, once.
	quoted string
}

var _ wsql.SchemaAdapter = schemaAdapter{}

// InsertQuery returns one multi-row INSERT for msgs. It validates every
// message first, so a bad one fails the whole call before anything is written.
func (a schemaAdapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	if len(msgs) == 0 {
		return wsql.Query{}, errors.New("no messages to insert")
	}
	if err := validateTopic(topic, a.republish); err != nil {
		return wsql.Query{}, err
	}
	table := a.quoted
	if table == "" {
		table = a.Table.Quoted()
	}
	var (
		sb   strings.Builder
		args = make([]any, 0, len(msgs)*8)
	)
	sb.WriteString(insertMark) // CommitWatch knows the outbox's inserts by it
	fmt.Fprintf(&sb, "INSERT INTO %s (message_uuid, aggregate_id, topic, payload, payload_raw, headers, available_at, due_at) VALUES ", table)
	for i, msg := range msgs {
		rowTopic := topic
		if t := msg.Metadata.Get(pipeline.MetaTopic); t != "" {
			if err := validateTopic(t, a.republish); err != nil {
				return wsql.Query{}, fmt.Errorf("message %d (%s): %w", i, msg.UUID, err)
			}
			rowTopic = t
		}
		row, err := outboxRowFromMessage(msg, a.Ordered != nil && a.Ordered(rowTopic), a.republish, a.maxDelay())
		if err != nil {
			return wsql.Query{}, fmt.Errorf("message %d (%s): %w", i, msg.UUID, err)
		}
		if i > 0 {
			sb.WriteString(", ")
		}
		n := len(args)
		// due_at is available_at as written: the relay's backoff moves only the latter.
		fmt.Fprintf(&sb, "($%[1]d, $%[2]d, $%[3]d, $%[4]d::jsonb, $%[5]d::bytea, $%[6]d::jsonb, COALESCE($%[7]d::timestamptz, now() + $%[8]d::bigint * interval '1 microsecond'), COALESCE($%[7]d::timestamptz, now() + $%[8]d::bigint * interval '1 microsecond'))",
			n+1, n+2, n+3, n+4, n+5, n+6, n+7, n+8)
		payload := msg.Payload
		if payload == nil {
			// Watermill's nil payload is an empty one; nil would be SQL
			// NULL, which the table's check refuses inside the caller's
			// transaction.
			payload = []byte{}
		}
		args = append(args, msg.UUID, row.aggregateID, rowTopic, row.jsonPayload, payload, string(row.headers), row.deliverAt, row.delay.Microseconds())
	}
	return wsql.Query{Query: sb.String(), Args: args}, nil
}

type insertRow struct {
	aggregateID string
	// jsonPayload is the payload as text when it is JSON that jsonb can
	// hold, nil otherwise.
	jsonPayload *string
	headers     []byte
	delay       time.Duration
	deliverAt   *time.Time
}

// outboxRowFromMessage checks msg and builds its row. Every check that the
// database would otherwise make is made here, so that a bad event is
// refused with a clear error and never aborts the caller's transaction.
func outboxRowFromMessage(msg *message.Message, ordered, republish bool, maxDelay time.Duration) (insertRow, error) {
	var row insertRow
	row.aggregateID = msg.Metadata.Get(pipeline.MetaAggregateID)
	switch {
	case msg.UUID == "":
		return row, fmt.Errorf("%w: message has no UUID", pipeline.ErrInvalidEvent)
	case len(msg.UUID) > MaxAggregateIDLength || !pipeline.ValidText(msg.UUID):
		return row, fmt.Errorf("%w: message UUID must be valid UTF-8 without NUL, at most %d bytes", pipeline.ErrInvalidEvent, MaxAggregateIDLength)
	case row.aggregateID == "" && ordered:
		return row, fmt.Errorf("%w: metadata %q is missing, and the topic is ordered (per aggregate)", pipeline.ErrInvalidEvent, pipeline.MetaAggregateID)
	case len(row.aggregateID) > MaxAggregateIDLength:
		return row, fmt.Errorf("%w: aggregate id is longer than %d bytes", pipeline.ErrInvalidEvent, MaxAggregateIDLength)
	case !pipeline.ValidText(row.aggregateID):
		return row, fmt.Errorf("%w: aggregate id must be valid UTF-8 without NUL", pipeline.ErrInvalidEvent)
	}
	if len(msg.Payload) > MaxPayloadBytes {
		return row, fmt.Errorf("%w: payload is %d bytes, more than %d", pipeline.ErrInvalidEvent, len(msg.Payload), MaxPayloadBytes)
	}
	if JSONBCanHold(msg.Payload) {
		text := string(msg.Payload)
		row.jsonPayload = &text
	}

	headers := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		switch k {
		case pipeline.MetaDelay:
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return row, fmt.Errorf("%w: %s %q is not a non-negative duration", pipeline.ErrInvalidEvent, k, v)
			}
			row.delay = d
		case pipeline.MetaDeliverAt:
			t, err := time.Parse(time.RFC3339Nano, v)
			if err != nil {
				return row, fmt.Errorf("%w: %s %q is not an RFC 3339 time", pipeline.ErrInvalidEvent, k, v)
			}
			row.deliverAt = &t
		case pipeline.MetaAggregateID, pipeline.MetaTopic:
			// Their own columns.
		default:
			if !republish && pipeline.ReservedMetadata(k) {
				return row, fmt.Errorf("%w: %w: %q (it carries a message's identity or delivery history, which consumers trust); the message's UUID is its id",
					pipeline.ErrInvalidEvent, pipeline.ErrReservedMetadata, k)
			}
			if republish {
				// Headers that came back from a delivery (a provider's
				// error text, a broker header) are stored, cleaned.
				k, v = pipeline.CleanText(k, 0), pipeline.CleanText(v, 0)
			} else if !pipeline.ValidText(k) || !pipeline.ValidText(v) {
				return row, fmt.Errorf("%w: metadata %q must be valid UTF-8 without NUL", pipeline.ErrInvalidEvent, pipeline.CleanText(k, 100))
			}
			headers[k] = v
		}
	}
	if _, ok := headers[pipeline.MetaCorrelationID]; !ok && !republish {
		// An event that comes with no correlation id gets its own id as
		// one here, at publish: every handler of it then logs, poisons and
		// publishes under the same id instead of minting one each.
		headers[pipeline.MetaCorrelationID] = msg.UUID
	}
	if err := checkDelay(row, republish, maxDelay); err != nil {
		return row, err
	}
	var err error
	row.headers, err = json.Marshal(headers)
	if err != nil {
		return row, fmt.Errorf("encoding headers: %w", err)
	}
	return row, nil
}

func (a schemaAdapter) maxDelay() time.Duration {
	if a.MaxDelay == 0 {
		return DefaultMaxDelay
	}
	return a.MaxDelay
}

// checkDelay refuses a producer's delay past maxDelay, and a delay given
// twice (a duration and a time: which one was meant?). Ferry's own writes
// (republish: a durable retry's backoff or deferral) are its own to bound.
func checkDelay(row insertRow, republish bool, maxDelay time.Duration) error {
	if republish {
		return nil
	}
	if row.deliverAt != nil && row.delay > 0 {
		return fmt.Errorf("%w: both %s and %s are set; give one", pipeline.ErrInvalidEvent, pipeline.MetaDelay, pipeline.MetaDeliverAt)
	}
	if maxDelay < 0 {
		return nil
	}
	if row.delay > maxDelay {
		return fmt.Errorf("%w: %s %s is longer than the outbox's bound, %s (FERRY_MAX_DELAY)", pipeline.ErrInvalidEvent, pipeline.MetaDelay, row.delay, maxDelay)
	}
	if row.deliverAt != nil && time.Until(*row.deliverAt) > maxDelay {
		return fmt.Errorf("%w: %s %s is further ahead than the outbox's bound, %s (FERRY_MAX_DELAY)", pipeline.ErrInvalidEvent, pipeline.MetaDeliverAt, row.deliverAt.Format(time.RFC3339), maxDelay)
	}
	return nil
}

// validateTopic is pipeline.ValidateTopicName, except that Ferry's own
// writes (republish: a durable retry) may use pipeline.RetryTopic.
func validateTopic(topic string, republish bool) error {
	if republish && topic == pipeline.RetryTopic {
		return nil
	}
	return pipeline.ValidateTopicName(topic)
}

// SelectQuery is not supported: the relay claims rows itself. The query
// returned selects nothing.
func (a schemaAdapter) SelectQuery(string, string, wsql.OffsetsAdapter) wsql.Query {
	return wsql.Query{Query: "SELECT NULL WHERE false"}
}

// UnmarshalMessage is not supported: the relay reads rows itself.
func (a schemaAdapter) UnmarshalMessage(wsql.Scanner) (wsql.Row, error) {
	return wsql.Row{}, ErrInsertOnly
}

// SchemaInitializingQueries returns nothing: the outbox table is created by
// Ferry's migrations, never implicitly inside a business transaction.
func (a schemaAdapter) SchemaInitializingQueries(string) []wsql.Query { return nil }

// SubscribeIsolationLevel is unused (insert-only adapter).
func (a schemaAdapter) SubscribeIsolationLevel() stdsql.IsolationLevel {
	return stdsql.LevelDefault
}
