// Package pgpoison is Ferry's poison store: the poison_messages table
// (migration 00005) that Watermill's PoisonQueue middleware publishes to
// through watermill-sql, and the operations on it behind `ferry poison`.
//
// A table rather than a broker queue, because what operators do with
// poisoned messages is look at them (filter by topic, see why and since
// when) and then requeue or discard some: a queue can only be read by taking
// messages off it. Requeue and discard are single transactions: requeue
// writes the message back into the outbox (for the relay to deliver) and
// deletes it here atomically, so an interrupted command loses and doubles
// nothing.
package pgpoison

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/ferry-dev/ferry/pipeline"
)

// Table is the poison store's table, created by Ferry's migrations.
const Table = "poison_messages"

// Bounds of what the poison store keeps of a message's texts.
const (
	// MaxReasonLength bounds the stored reason.
	MaxReasonLength = 4096
	// MaxHeaderLength bounds each stored header value.
	MaxHeaderLength = 16384
	// maxKeyLength bounds header names and the id, topic, handler,
	// aggregate and correlation columns.
	maxKeyLength = 512
)

// bookkeeping are the keys that describe a failure, not the message: they
// are dropped when a message is requeued.
var bookkeeping = []string{
	wmw.ReasonForPoisonedKey, wmw.PoisonedTopicKey, wmw.PoisonedHandlerKey, wmw.PoisonedSubscriberKey,
	pipeline.MetaPoisonedAt, pipeline.MetaPoisonPermanent, pipeline.MetaPoisonedConsumer,
	pipeline.MetaAttempt, pipeline.MetaFirstFailedAt, pipeline.MetaLastFailedAt, pipeline.MetaLastError,
	pipeline.MetaRetryQueue, pipeline.MetaOriginalTopic, pipeline.MetaOutboxAttempt, pipeline.MetaOutboxCreatedAt,
	pipeline.MetaAggregateID, "x-delivery-count",
}

// SchemaAdapter is an insert-only watermill-sql SchemaAdapter writing
// poisoned messages into poison_messages. The topic of the Publish call is
// ignored: the message's own metadata says where it came from.
type SchemaAdapter struct{}

var _ wsql.SchemaAdapter = SchemaAdapter{}

// InsertQuery implements wsql.SchemaAdapter.
func (SchemaAdapter) InsertQuery(_ string, msgs message.Messages) (wsql.Query, error) {
	if len(msgs) == 0 {
		return wsql.Query{}, errors.New("no messages to insert")
	}
	var sb strings.Builder
	sb.WriteString(`INSERT INTO ` + Table + ` (message_id, topic, handler, consumer, aggregate_id, payload, headers,
		reason, permanent, attempts, first_failed_at, last_failed_at, poisoned_at, correlation_id) VALUES `)
	var args []any
	now := time.Now().UTC()
	for i, m := range msgs {
		if i > 0 {
			sb.WriteString(", ")
		}
		// Every text is cleaned (pipeline.CleanText) and bounded: a reason
		// or header that PostgreSQL cannot store (a provider's Latin-1 body,
		// a NUL) must not make the poison store refuse the message, which
		// would leave it nacked and redelivered forever.
		md := make(message.Metadata, len(m.Metadata))
		for k, v := range m.Metadata {
			md[pipeline.CleanText(k, maxKeyLength)] = pipeline.CleanText(v, MaxHeaderLength)
		}
		// The reason is a handler's error text: personal data it quotes
		// stays out of the store (pipeline.RedactPersonal).
		if r, ok := md[wmw.ReasonForPoisonedKey]; ok {
			md[wmw.ReasonForPoisonedKey] = pipeline.RedactText(r, MaxHeaderLength)
		}
		headers, err := json.Marshal(map[string]string(md))
		if err != nil {
			return wsql.Query{}, fmt.Errorf("encoding headers of %s: %w", m.UUID, err)
		}
		reason := pipeline.CleanText(md.Get(wmw.ReasonForPoisonedKey), MaxReasonLength)
		if reason == "" {
			reason = "(no reason recorded)"
		}
		text := func(s string) string { return pipeline.CleanText(s, maxKeyLength) }
		n := len(args)
		ph := make([]string, 14)
		for j := range ph {
			ph[j] = "$" + strconv.Itoa(n+j+1)
		}
		ph[6] += "::jsonb"
		sb.WriteString("(" + strings.Join(ph, ", ") + ")")
		args = append(args,
			text(pipeline.MessageID(m)), text(pipeline.OriginalTopic(m, md.Get(wmw.PoisonedTopicKey))),
			text(md.Get(wmw.PoisonedHandlerKey)), text(md.Get(pipeline.MetaPoisonedConsumer)), text(md.Get(pipeline.MetaAggregateID)),
			[]byte(m.Payload), string(headers), reason, md.Get(pipeline.MetaPoisonPermanent) == "true",
			pipeline.DeliveryAttempt(m), timeOr(md.Get(pipeline.MetaFirstFailedAt), now),
			timeOr(md.Get(pipeline.MetaLastFailedAt), now), timeOr(md.Get(pipeline.MetaPoisonedAt), now),
			text(md.Get(pipeline.MetaCorrelationID)))
	}
	return wsql.Query{Query: sb.String(), Args: args}, nil
}

func timeOr(s string, def time.Time) time.Time {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t
	}
	return def
}

// SelectQuery is not supported (the store is read with Store).
func (SchemaAdapter) SelectQuery(string, string, wsql.OffsetsAdapter) wsql.Query {
	return wsql.Query{Query: "SELECT NULL WHERE false"}
}

// UnmarshalMessage is not supported (the store is read with Store).
func (SchemaAdapter) UnmarshalMessage(wsql.Scanner) (wsql.Row, error) {
	return wsql.Row{}, errors.New("pgpoison.SchemaAdapter is insert-only: use pgpoison.Store")
}

// SchemaInitializingQueries returns nothing: migrations create the table.
func (SchemaAdapter) SchemaInitializingQueries(string) []wsql.Query { return nil }

// SubscribeIsolationLevel is unused.
func (SchemaAdapter) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelDefault }

// NewPublisher returns the poison queue's publisher: watermill-sql over db,
// writing poison_messages. Each Publish is its own statement, so the message
// is durably stored when Publish returns and may then be acked.
func NewPublisher(db *stdsql.DB) (message.Publisher, error) {
	return wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: SchemaAdapter{}}, nil)
}
