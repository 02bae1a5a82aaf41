// Package tracing carries W3C trace context (OpenTelemetry) through Ferry:
// from an HTTP request into the events it causes (their traceparent header,
// stored in the outbox row and sent as an AMQP header), from a consumed
// message into its handler's context and spans, and on into the events the
// handler publishes. The wire format is W3C Trace Context whatever the
// process's global propagator; spans go to the TracerProvider given, or to
// the global one (a no-op until the application installs an SDK, in which
// case the trace id still travels unchanged).
package tracing

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferry-dev/ferry/pipeline"
)

// TracerName names Ferry's tracer.
const TracerName = "github.com/ferry-dev/ferry"

var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// Tracer starts Ferry's spans.
type Tracer struct {
	tracer trace.Tracer
}

// New returns a Tracer on provider (nil: the global TracerProvider).
func New(provider trace.TracerProvider) *Tracer {
	if provider == nil {
		provider = otel.GetTracerProvider()
	}
	return &Tracer{tracer: provider.Tracer(TracerName)}
}

// metadataCarrier lets the propagator read and write message metadata.
type metadataCarrier message.Metadata

func (c metadataCarrier) Get(key string) string { return c[key] }
func (c metadataCarrier) Set(key, value string) { c[key] = value }
func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// withPipelineContext puts the current span's traceparent where
// pipeline.NewEvent looks for it, so events published from ctx continue the trace.
func withPipelineContext(ctx context.Context) context.Context {
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	if tp := carrier.Get("traceparent"); tp != "" {
		ctx = pipeline.ContextWithTraceParent(ctx, tp)
	}
	return ctx
}

// CorrelationHeader is the request header whose value becomes the
// correlation id of the events a request publishes; the response carries
// the id used.
const CorrelationHeader = "X-Correlation-ID"

// maxCorrelationID bounds a correlation id taken from a request.
const maxCorrelationID = 128

// HTTP continues the request's trace (its traceparent header, if any) in a
// server span around next, and makes the events next publishes part of it:
// their trace context, and their correlation id, taken from the request's
// X-Correlation-ID (printable ASCII, at most 128 bytes) or made here, and
// sent back in the response's X-Correlation-ID.
func (t *Tracer) HTTP(name string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := propagator.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
		defer span.End()
		id := r.Header.Get(CorrelationHeader)
		if !printableID(id) {
			id = watermill.NewUUID()
		}
		w.Header().Set(CorrelationHeader, id)
		span.SetAttributes(attribute.String("ferry.correlation_id", id))
		ctx = pipeline.ContextWithCorrelationID(withPipelineContext(ctx), id)
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// printableID accepts a correlation id a client sent: 1 to 128 bytes of
// printable ASCII, so it can go into logs, headers and the poison store as
// it is.
func printableID(s string) bool {
	if s == "" || len(s) > maxCorrelationID {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// Consumer is the chain link that continues a consumed message's trace in
// a consumer span around the rest of the chain and the handler.
func (t *Tracer) Consumer(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := propagator.Extract(msg.Context(), metadataCarrier(msg.Metadata))
		topic := pipeline.OriginalTopic(msg, message.SubscribeTopicFromCtx(ctx))
		ctx, span := t.tracer.Start(ctx, "consume "+topic, trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(
				attribute.String("messaging.system", "rabbitmq"),
				attribute.String("messaging.destination.name", topic),
				attribute.String("messaging.message.id", pipeline.MessageID(msg)),
				attribute.String("messaging.consumer.group.name", pipeline.RouteName(message.HandlerNameFromCtx(ctx))),
				attribute.Int("ferry.attempt", pipeline.DeliveryAttempt(msg)),
			))
		defer span.End()
		if tid := span.SpanContext().TraceID(); tid.IsValid() {
			if msg.Metadata.Get(pipeline.MetaTraceID) == "" {
				// A trace that starts here: its id joins the log attributes
				// the correlation link set from the message.
				ctx = pipeline.ContextWithLogAttrs(ctx, slog.String("trace_id", tid.String()))
			}
			msg.Metadata.Set(pipeline.MetaTraceID, tid.String())
		}
		msg.SetContext(withPipelineContext(ctx))
		failedBefore, poisonedBefore := msg.Metadata.Get(pipeline.MetaLastFailedAt), msg.Metadata.Get(pipeline.MetaPoisonedAt)
		produced, err := h(msg)
		switch {
		case err != nil:
			span.RecordError(err)
			span.SetStatus(codes.Error, pipeline.CleanText(err.Error(), 1024))
		case msg.Metadata.Get(pipeline.MetaPoisonedAt) != poisonedBefore:
			// Acked because the poison store has it: the delivery failed.
			span.SetStatus(codes.Error, "poisoned: "+pipeline.CleanText(msg.Metadata.Get(pipeline.MetaLastError), 1024))
		case msg.Metadata.Get(pipeline.MetaLastFailedAt) != failedBefore:
			// Acked because a durable retry is scheduled: it failed too.
			span.SetStatus(codes.Error, "failed; durable retry scheduled: "+pipeline.CleanText(msg.Metadata.Get(pipeline.MetaLastError), 1024))
		}
		for _, p := range produced {
			propagator.Inject(ctx, metadataCarrier(p.Metadata))
		}
		return produced, err
	}
}

// Attempt is the chain link, inside the durable retry, that gives every
// attempt of a delivery its own span ("attempt <n> <topic>", a child of
// the consumer span), failed ones with status Error: a head held in
// process through its retries shows one span per try, not one open span
// for the whole hold.
func (t *Tracer) Attempt(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		parent := msg.Context()
		attempt := pipeline.DeliveryAttempt(msg)
		ctx, span := t.tracer.Start(parent, "attempt "+strconv.Itoa(attempt)+" "+pipeline.OriginalTopic(msg, message.SubscribeTopicFromCtx(parent)),
			trace.WithAttributes(attribute.Int("ferry.attempt", attempt)))
		defer span.End()
		msg.SetContext(ctx)
		defer msg.SetContext(parent)
		produced, err := h(msg)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, pipeline.CleanText(err.Error(), 1024))
		}
		return produced, err
	}
}

// StartPublish is the relay's span for one event (pgoutbox.PublishSpans):
// a producer span "publish <topic>", child of the trace the event was
// written in (its traceparent header), with the topic, the message id and
// the outbox row id. The span's context replaces the event's traceparent,
// so the consumer's span follows from it: a trace runs from the request
// through the relay to the handler without a gap.
func (t *Tracer) StartPublish(ctx context.Context, topic string, outboxID int64, msg *message.Message) func(error) {
	parent := propagator.Extract(context.WithoutCancel(ctx), metadataCarrier(msg.Metadata))
	sctx, span := t.tracer.Start(parent, "publish "+topic, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			attribute.String("messaging.system", "rabbitmq"),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.destination.name", topic),
			attribute.String("messaging.message.id", msg.UUID),
			attribute.Int64("ferry.outbox_id", outboxID),
		))
	if span.SpanContext().IsValid() {
		propagator.Inject(sctx, metadataCarrier(msg.Metadata))
		if msg.Metadata.Get(pipeline.MetaTraceID) == "" {
			msg.Metadata.Set(pipeline.MetaTraceID, span.SpanContext().TraceID().String())
		}
	}
	return func(err error) {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// TraceID returns the trace id of ctx's span, or "".
func TraceID(ctx context.Context) string {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		return sc.TraceID().String()
	}
	return ""
}
