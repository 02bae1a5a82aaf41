package middleware_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
)

// A message that carries a correlation id hands it, with its trace
// context and tenant, to the handler's context (where pipeline.NewEvent
// finds it), to every log line of the handler, and to the messages it
// returns.
func TestCorrelationCarriesTheMessagesIDs(t *testing.T) {
	msg := message.NewMessage("m-1", []byte(`{}`))
	msg.Metadata.Set(pipeline.MetaCorrelationID, "corr-7")
	msg.Metadata.Set(pipeline.MetaTraceParent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	msg.Metadata.Set(pipeline.MetaTraceID, "4bf92f3577b34da6a3ce929d0e0e4736")
	msg.Metadata.Set(pipeline.MetaTenantID, "acme")
	msg.Metadata.Set(pipeline.MetaAggregateID, "order-1")
	msg.Metadata.Set(pipeline.MetaAttempt, "3")
	msg.SetContext(context.Background())

	var seen context.Context
	out, err := middleware.Correlation(func(m *message.Message) ([]*message.Message, error) {
		seen = m.Context()
		return []*message.Message{message.NewMessage("p-1", nil)}, nil
	})(msg)
	require.NoError(t, err)
	require.Equal(t, "corr-7", pipeline.CorrelationIDFromContext(seen))
	require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", pipeline.TraceParentFromContext(seen))
	require.Equal(t, "acme", pipeline.TenantIDFromContext(seen))
	require.Len(t, out, 1)
	require.Equal(t, "corr-7", wmw.MessageCorrelationID(out[0]), "a returned message keeps the correlation")

	attrs := map[string]slog.Value{}
	for _, a := range pipeline.LogAttrs(seen) {
		attrs[a.Key] = a.Value
	}
	require.Equal(t, "m-1", attrs["message_id"].String())
	require.Equal(t, "order-1", attrs["aggregate_id"].String())
	require.EqualValues(t, 3, attrs["attempt"].Int64())
	require.Equal(t, "corr-7", attrs["correlation_id"].String())
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", attrs["trace_id"].String())
}

// A message from outside Ferry's outbox has no correlation id: its own
// message id becomes it, written back into its metadata so that every
// handler of it shares the one id, and no trace or tenant is made up.
func TestCorrelationFallsBackToTheMessageID(t *testing.T) {
	msg := message.NewMessage("m-2", []byte(`{}`))
	msg.SetContext(context.Background())
	var seen context.Context
	_, err := middleware.Correlation(func(m *message.Message) ([]*message.Message, error) {
		seen = m.Context()
		return nil, nil
	})(msg)
	require.NoError(t, err)
	require.Equal(t, "m-2", pipeline.CorrelationIDFromContext(seen))
	require.Equal(t, "m-2", msg.Metadata.Get(pipeline.MetaCorrelationID))
	require.Empty(t, pipeline.TraceParentFromContext(seen))
	require.Empty(t, pipeline.TenantIDFromContext(seen))
	for _, a := range pipeline.LogAttrs(seen) {
		require.NotEqual(t, "trace_id", a.Key, "no trace id is made up")
	}
}

// The handler's error comes back unchanged, with the messages it returned.
func TestCorrelationReturnsTheHandlersError(t *testing.T) {
	msg := message.NewMessage("m-3", nil)
	msg.SetContext(context.Background())
	boom := pipeline.Permanent(context.Canceled)
	out, err := middleware.Correlation(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("p", nil)}, boom
	})(msg)
	require.ErrorIs(t, err, boom)
	require.Len(t, out, 1)
	require.Equal(t, "m-3", wmw.MessageCorrelationID(out[0]))
}
