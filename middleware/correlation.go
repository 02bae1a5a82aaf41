package middleware

import (
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/ferry-dev/ferry/pipeline"
)

// Correlation takes the message's correlation id, or, when it has none
// (a message that did not come through Ferry's outbox, which gives every
// event one), its message id: every handler of one message shares it. It
// puts it (with the trace context and tenant) in the message's
// context, where pipeline.NewEvent finds it for every event the handler
// publishes through the outbox. Messages the handler returns get it too.
func Correlation(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		id := msg.Metadata.Get(pipeline.MetaCorrelationID)
		if id == "" {
			id = pipeline.MessageID(msg)
			msg.Metadata.Set(pipeline.MetaCorrelationID, id)
		}
		ctx := pipeline.ContextWithCorrelationID(msg.Context(), id)
		if tp := msg.Metadata.Get(pipeline.MetaTraceParent); tp != "" {
			ctx = pipeline.ContextWithTraceParent(ctx, tp)
		}
		if tenant := msg.Metadata.Get(pipeline.MetaTenantID); tenant != "" {
			ctx = pipeline.ContextWithTenantID(ctx, tenant)
		}
		// Every line logged with this context, the handler's own included,
		// says which message it is about.
		attrs := []slog.Attr{
			slog.String("message_id", pipeline.MessageID(msg)),
			slog.String("topic", pipeline.OriginalTopic(msg, message.SubscribeTopicFromCtx(ctx))),
			slog.String("aggregate_id", msg.Metadata.Get(pipeline.MetaAggregateID)),
			slog.Int("attempt", pipeline.DeliveryAttempt(msg)),
			slog.String("correlation_id", id),
		}
		if tid := msg.Metadata.Get(pipeline.MetaTraceID); tid != "" {
			attrs = append(attrs, slog.String("trace_id", tid))
		}
		ctx = pipeline.ContextWithLogAttrs(ctx, attrs...)
		msg.SetContext(ctx)

		produced, err := h(msg)
		for _, p := range produced {
			wmw.SetCorrelationID(id, p)
		}
		return produced, err
	}
}
