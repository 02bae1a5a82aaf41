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
	// MetaOutboxCreatedAt is set by the relay: when the outbox row was
	// written (RFC 3339), so consumers can measure end-to-end latency.
	MetaOutboxCreatedAt = "outbox_created_at"
	// MetaOutboxAttempt is set by the relay: which relay attempt this
	// publish is (1 for the first).
	MetaOutboxAttempt = "outbox_attempt"

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
// metadata, so every event caused by one request can be followed.
func NewEvent(ctx context.Context, aggregateID string, payload any) (*message.Message, error) {
	if aggregateID == "" {
		return nil, fmt.Errorf("%w: aggregate id is empty", ErrInvalidEvent)
	}
	body, err := json.Marshal(payload)
	if err != nil {
		return nil, fmt.Errorf("%w: encoding payload: %w", ErrInvalidEvent, err)
	}
	msg := message.NewMessage(watermill.NewUUID(), body)
	msg.Metadata.Set(MetaAggregateID, aggregateID)
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
func WithDelay(msg *message.Message, d time.Duration) *message.Message {
	msg.Metadata.Set(MetaDelay, d.String())
	return msg
}

// WithDeliverAt asks the outbox to hold msg back until t.
func WithDeliverAt(msg *message.Message, t time.Time) *message.Message {
	msg.Metadata.Set(MetaDeliverAt, t.UTC().Format(time.RFC3339Nano))
	return msg
}

// Attempt returns the relay attempt recorded on msg (MetaOutboxAttempt), or 0.
func Attempt(msg *message.Message) int {
	n, err := strconv.Atoi(msg.Metadata.Get(MetaOutboxAttempt))
	if err != nil {
		return 0
	}
	return n
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
