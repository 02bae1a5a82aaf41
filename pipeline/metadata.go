package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// Metadata keys carried by every Ferry event. They are stored in the outbox
// row's headers column, travel as AMQP headers and come back as Watermill
// metadata on the consumer side.
const (
	// MetaAggregateID names the entity the event is about (an order id, say).
	// Ordered topics keep per-aggregate order; it is its own outbox column.
	MetaAggregateID = "aggregate_id"
	// MetaCorrelationID ties every message caused by one request together.
	// It is Watermill's key, so Watermill's own middleware sees the same id.
	MetaCorrelationID = wmiddleware.CorrelationIDMetadataKey
	// MetaTraceParent is the W3C trace context of the request that caused the event.
	MetaTraceParent = "traceparent"
	// MetaTraceID is the trace id part of MetaTraceParent, kept apart so that
	// operators can grep for it in the outbox headers.
	MetaTraceID = "trace_id"
	// MetaSchemaVersion is the version of the payload's schema; consumers
	// reject versions they do not know instead of guessing.
	MetaSchemaVersion = "schema_version"
	// MetaTenantID names the tenant in multi-tenant deployments.
	MetaTenantID = "tenant_id"
	// MetaShadow is "true" on a shadow intent (shadow mode, while the legacy
	// code still performs the effect): the relay marks it dispatched
	// without publishing it.
	MetaShadow = "shadow_mode"
	// MetaOutboxCreatedAt is set by the relay: when the outbox row was
	// written (RFC 3339), so consumers can measure end-to-end latency.
	MetaOutboxCreatedAt = "outbox_created_at"
	// MetaOutboxID is set by the relay: the outbox row's id. The message's
	// UUID is the publisher's own; the row id is only the row's key.
	MetaOutboxID = "ferry_outbox_id"
	// MetaOutboxAttempt is set by the relay: which relay attempt this
	// publish is (1 for the first).
	MetaOutboxAttempt = "outbox_attempt"

	// MetaMessageID is set on durable retries and requeues: the UUID the
	// message was first published with, which they keep as their own UUID.
	// It is for operators reading headers; identity is the UUID (see
	// MessageID), and only Ferry sets this key (see ReservedMetadata).
	MetaMessageID = "ferry_message_id"
	// MetaAttempt is the consumer-side delivery attempt of the message,
	// 1 for the first; durable retries count it up.
	MetaAttempt = "ferry_attempt"
	// MetaOriginalTopic is the topic a retried message was first published to.
	MetaOriginalTopic = "ferry_original_topic"
	// MetaRetryQueue is the queue (without namespace) a durable retry goes
	// back to: only the handler that failed sees it again.
	MetaRetryQueue = "ferry_retry_queue"
	// MetaParkedSeq is set on an event of an ordered partition sent back
	// to it after it was parked while its tenant's database was out of
	// reach (tenancy.Parking): its place among the tenant's parked events.
	MetaParkedSeq = "ferry_parked_seq"
	// MetaFirstFailedAt and MetaLastFailedAt bracket a message's failures (RFC 3339).
	MetaFirstFailedAt = "ferry_first_failed_at"
	MetaLastFailedAt  = "ferry_last_failed_at"
	// MetaLastError is the error of the latest failed attempt.
	MetaLastError = "ferry_last_error"
	// MetaErrorHistory is the message's failed attempts as a JSON array of
	// FailedAttempt, the newest last, at most MaxErrorHistory of them.
	MetaErrorHistory = "ferry_error_history"

	// MetaPoisonedAt is when a message was poisoned (RFC 3339).
	MetaPoisonedAt = "poisoned_at"
	// MetaPoisonPermanent is "true" when a poisoned message's error was
	// marked Permanent (not retried), "false" when its attempts ran out.
	MetaPoisonPermanent = "poison_permanent"
	// MetaPoisonedConsumer is the router handler that gave up: the route's
	// name with its partition or worker suffix ("payments.charge@3").
	MetaPoisonedConsumer = "consumer_poisoned"

	// MetaDelay asks the outbox not to relay the event before now+delay
	// (a Go duration). It is consumed by the outbox and not stored in headers.
	MetaDelay = "ferry_delay"
	// MetaDeliverAt asks the outbox not to relay the event before an
	// instant (RFC 3339). It is consumed by the outbox and not stored in headers.
	MetaDeliverAt = "ferry_deliver_at"
	// MetaTopic overrides, per message, the topic a Publish call names, so
	// that events of several topics go into the outbox in one statement
	// (pgoutbox.Outbox.PublishEventsTx sets it). Consumed by the outbox.
	MetaTopic = "ferry_topic"
)

// DefaultSchemaVersion is the schema version NewEvent stamps when the caller
// does not choose one.
const DefaultSchemaVersion = "1"

// ErrInvalidEvent is returned by NewEvent for input that cannot become an event.
var ErrInvalidEvent = errors.New("invalid event")

// NewEvent builds the Watermill message for one event about aggregateID,
// with payload encoded as JSON. The correlation id and trace context of ctx
// (see ContextWithCorrelationID, ContextWithTraceParent) are copied into its
// metadata, so every event caused by one request can be followed; without
// one, the outbox gives the event its own id as correlation id.
//
// aggregateID may be empty for a topic that is not ordered; the outbox
// refuses an event without one on an ordered topic (its order is per
// aggregate).
func NewEvent(ctx context.Context, aggregateID string, payload any) (*message.Message, error) {
	body, err := json.Marshal(payload)
	if err != nil {
		return nil, fmt.Errorf("%w: encoding payload: %w", ErrInvalidEvent, err)
	}
	msg := message.NewMessage(watermill.NewUUID(), body)
	if aggregateID != "" {
		msg.Metadata.Set(MetaAggregateID, aggregateID)
	}
	msg.Metadata.Set(MetaSchemaVersion, DefaultSchemaVersion)
	if id := CorrelationIDFromContext(ctx); id != "" {
		msg.Metadata.Set(MetaCorrelationID, id)
	}
	if tp := TraceParentFromContext(ctx); tp != "" {
		msg.Metadata.Set(MetaTraceParent, tp)
		if traceID, ok := TraceIDFromTraceParent(tp); ok {
			msg.Metadata.Set(MetaTraceID, traceID)
		}
	}
	if tenant := TenantIDFromContext(ctx); tenant != "" {
		msg.Metadata.Set(MetaTenantID, tenant)
	}
	return msg, nil
}

// WithDelay asks the outbox to hold msg back for d ("send the welcome mail in
// three minutes"). The delay is measured on the database's clock at insert.
// The outbox refuses a delay past its bound (FERRY_MAX_DELAY, a year by
// default) and a message that also has WithDeliverAt.
func WithDelay(msg *message.Message, d time.Duration) *message.Message {
	msg.Metadata.Set(MetaDelay, d.String())
	return msg
}

// WithDeliverAt asks the outbox to hold msg back until t (at most
// FERRY_MAX_DELAY ahead; not with WithDelay).
func WithDeliverAt(msg *message.Message, t time.Time) *message.Message {
	msg.Metadata.Set(MetaDeliverAt, t.UTC().Format(time.RFC3339Nano))
	return msg
}

// WithShadow marks msg as a shadow intent (MetaShadow) and returns it.
func WithShadow(msg *message.Message) *message.Message {
	msg.Metadata.Set(MetaShadow, "true")
	return msg
}

// RetryTopic is the topic durable retries are relayed on; its exchange
// routes each by MetaRetryQueue straight to the queue that failed it.
const RetryTopic = "ferry.retry"

// Retry is a message to deliver again, durably, after Delay.
type Retry struct {
	AggregateID string
	Payload     []byte
	Headers     map[string]string
	Delay       time.Duration
}

// MessageID is the id that identifies msg across redeliveries, retries and
// requeues, and the downstream idempotency key: the UUID its publisher gave
// it, end to end. Durable retries and requeues keep that UUID; no metadata
// can replace it, so a producer cannot make one message two.
func MessageID(msg *message.Message) string {
	return msg.UUID
}

// DeliveryAttempt returns the consumer-side attempt of msg (MetaAttempt), 1 if unset.
func DeliveryAttempt(msg *message.Message) int {
	n, err := strconv.Atoi(msg.Metadata.Get(MetaAttempt))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

// OriginalTopic returns the topic msg was first published to: the
// MetaOriginalTopic it carries, or subscribed.
func OriginalTopic(msg *message.Message, subscribed string) string {
	if t := msg.Metadata.Get(MetaOriginalTopic); t != "" {
		return t
	}
	return subscribed
}

type ctxKey int

const (
	correlationIDKey ctxKey = iota
	traceParentKey
	tenantIDKey
)

// ContextWithCorrelationID returns ctx carrying id; events built from it
// with NewEvent carry the same id.
func ContextWithCorrelationID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, correlationIDKey, id)
}

// CorrelationIDFromContext returns the correlation id of ctx, or "".
func CorrelationIDFromContext(ctx context.Context) string {
	id, _ := ctx.Value(correlationIDKey).(string)
	return id
}

// ContextWithTraceParent returns ctx carrying a W3C traceparent value.
func ContextWithTraceParent(ctx context.Context, traceParent string) context.Context {
	return context.WithValue(ctx, traceParentKey, traceParent)
}

// TraceParentFromContext returns the W3C traceparent of ctx, or "".
func TraceParentFromContext(ctx context.Context) string {
	tp, _ := ctx.Value(traceParentKey).(string)
	return tp
}

// ContextWithTenantID returns ctx carrying a tenant id.
func ContextWithTenantID(ctx context.Context, tenant string) context.Context {
	return context.WithValue(ctx, tenantIDKey, tenant)
}

// TenantIDFromContext returns the tenant id of ctx, or "".
func TenantIDFromContext(ctx context.Context) string {
	t, _ := ctx.Value(tenantIDKey).(string)
	return t
}

// TraceIDFromTraceParent extracts the trace id from a W3C traceparent
// ("00-<32 hex trace id>-<16 hex span id>-<2 hex flags>").
func TraceIDFromTraceParent(tp string) (string, bool) {
	if len(tp) != 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-' {
		return "", false
	}
	traceID := tp[3:35]
	for _, c := range traceID {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return "", false
		}
	}
	if traceID == "00000000000000000000000000000000" {
		return "", false
	}
	return traceID, true
}
