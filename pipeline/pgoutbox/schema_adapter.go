package pgoutbox

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Limits enforced before anything is written.
const (
	// MaxTopicLength is RabbitMQ's limit on exchange names.
	MaxTopicLength = 255
	// MaxAggregateIDLength keeps the per-aggregate index small.
	MaxAggregateIDLength = 512
	// MaxPayloadBytes bounds one event; large blobs belong in object storage,
	// with a reference in the event.
	MaxPayloadBytes = 1 << 20
)

// ErrInsertOnly is returned by the parts of SchemaAdapter that watermill-sql
// would use for subscribing: the relay reads the outbox itself.
var ErrInsertOnly = errors.New("pgoutbox.SchemaAdapter is insert-only: use pgoutbox.Relay to read the outbox")

// SchemaAdapter is a watermill-sql SchemaAdapter that writes Ferry's outbox
// table instead of watermill-sql's per-topic message tables. The message's
// metadata supplies the aggregate id (pipeline.MetaAggregateID, required)
// and the delay (pipeline.MetaDelay or pipeline.MetaDeliverAt); the rest of
// the metadata becomes the row's headers.
//
// It creates no schema (migrations own the table), so it is safe to use
// with a transaction as the publisher's database handle.
type SchemaAdapter struct {
	// Table is the outbox table's name, optionally schema-qualified. Default "outbox".
	Table string
}

var _ wsql.SchemaAdapter = SchemaAdapter{}

func (a SchemaAdapter) table() string {
	if a.Table == "" {
		return "outbox"
	}
	return a.Table
}

// InsertQuery returns one multi-row INSERT for msgs. It validates every
// message first, so a bad one fails the whole call before anything is written.
func (a SchemaAdapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	if len(msgs) == 0 {
		return wsql.Query{}, errors.New("no messages to insert")
	}
	if err := validateTopic(topic); err != nil {
		return wsql.Query{}, err
	}
	var (
		sb   strings.Builder
		args = make([]any, 0, len(msgs)*6)
	)
	fmt.Fprintf(&sb, "INSERT INTO %s (aggregate_id, topic, payload, headers, available_at) VALUES ", a.table())
	for i, msg := range msgs {
		row, err := outboxRowFromMessage(msg)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("message %d (%s): %w", i, msg.UUID, err)
		}
		if i > 0 {
			sb.WriteString(", ")
		}
		rowTopic := topic
		if t := msg.Metadata.Get(pipeline.MetaTopic); t != "" {
			if err := validateTopic(t); err != nil {
				return wsql.Query{}, fmt.Errorf("message %d (%s): %w", i, msg.UUID, err)
			}
			rowTopic = t
		}
		n := len(args)
		fmt.Fprintf(&sb, "($%d, $%d, $%d::jsonb, $%d::jsonb, COALESCE($%d::timestamptz, now() + $%d::bigint * interval '1 microsecond'))",
			n+1, n+2, n+3, n+4, n+5, n+6)
		args = append(args, row.aggregateID, rowTopic, string(msg.Payload), string(row.headers), row.deliverAt, row.delay.Microseconds())
	}
	return wsql.Query{Query: sb.String(), Args: args}, nil
}

type insertRow struct {
	aggregateID string
	headers     []byte
	delay       time.Duration
	deliverAt   *time.Time
}

func outboxRowFromMessage(msg *message.Message) (insertRow, error) {
	var row insertRow
	row.aggregateID = msg.Metadata.Get(pipeline.MetaAggregateID)
	switch {
	case row.aggregateID == "":
		return row, fmt.Errorf("%w: metadata %q is missing", pipeline.ErrInvalidEvent, pipeline.MetaAggregateID)
	case len(row.aggregateID) > MaxAggregateIDLength:
		return row, fmt.Errorf("%w: aggregate id is longer than %d bytes", pipeline.ErrInvalidEvent, MaxAggregateIDLength)
	case !utf8.ValidString(row.aggregateID):
		return row, fmt.Errorf("%w: aggregate id is not valid UTF-8", pipeline.ErrInvalidEvent)
	}
	if len(msg.Payload) > MaxPayloadBytes {
		return row, fmt.Errorf("%w: payload is %d bytes, more than %d", pipeline.ErrInvalidEvent, len(msg.Payload), MaxPayloadBytes)
	}
	if !json.Valid(msg.Payload) {
		return row, fmt.Errorf("%w: payload is not valid JSON", pipeline.ErrInvalidEvent)
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
			if !utf8.ValidString(k) || !utf8.ValidString(v) {
				return row, fmt.Errorf("%w: metadata %q is not valid UTF-8", pipeline.ErrInvalidEvent, k)
			}
			headers[k] = v
		}
	}
	var err error
	row.headers, err = json.Marshal(headers)
	if err != nil {
		return row, fmt.Errorf("encoding headers: %w", err)
	}
	return row, nil
}

func validateTopic(topic string) error {
	switch {
	case topic == "":
		return fmt.Errorf("%w: topic is empty", pipeline.ErrInvalidEvent)
	case len(topic) > MaxTopicLength:
		return fmt.Errorf("%w: topic is longer than %d bytes", pipeline.ErrInvalidEvent, MaxTopicLength)
	}
	return nil
}

// SelectQuery is not supported: the relay claims rows itself. The query
// returned selects nothing.
func (a SchemaAdapter) SelectQuery(string, string, wsql.OffsetsAdapter) wsql.Query {
	return wsql.Query{Query: "SELECT NULL WHERE false"}
}

// UnmarshalMessage is not supported: the relay reads rows itself.
func (a SchemaAdapter) UnmarshalMessage(wsql.Scanner) (wsql.Row, error) {
	return wsql.Row{}, ErrInsertOnly
}

// SchemaInitializingQueries returns nothing: the outbox table is created by
// Ferry's migrations, never implicitly inside a business transaction.
func (a SchemaAdapter) SchemaInitializingQueries(string) []wsql.Query { return nil }

// SubscribeIsolationLevel is unused (insert-only adapter).
func (a SchemaAdapter) SubscribeIsolationLevel() stdsql.IsolationLevel {
	return stdsql.LevelDefault
}
