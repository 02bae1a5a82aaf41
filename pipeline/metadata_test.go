package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
)

func TestNewEventCarriesContext(t *testing.T) {
	t.Parallel()
	ctx := pipeline.ContextWithCorrelationID(context.Background(), "corr-1")
	ctx = pipeline.ContextWithTraceParent(ctx, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	ctx = pipeline.ContextWithTenantID(ctx, "acme")

	msg, err := pipeline.NewEvent(ctx, "order-7", map[string]int{"amount": 5})
	require.NoError(t, err)
	require.JSONEq(t, `{"amount":5}`, string(msg.Payload))
	require.Equal(t, "order-7", msg.Metadata.Get(pipeline.MetaAggregateID))
	require.Equal(t, "corr-1", msg.Metadata.Get(pipeline.MetaCorrelationID))
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", msg.Metadata.Get(pipeline.MetaTraceID))
	require.Equal(t, "acme", msg.Metadata.Get(pipeline.MetaTenantID))
	require.Equal(t, pipeline.DefaultSchemaVersion, msg.Metadata.Get(pipeline.MetaSchemaVersion))
}

func TestNewEventRejectsBadInput(t *testing.T) {
	t.Parallel()
	// No aggregate is fine for an unordered topic (the outbox refuses it
	// on an ordered one): the event carries no aggregate header.
	msg, err := pipeline.NewEvent(context.Background(), "", 1)
	require.NoError(t, err)
	require.Empty(t, msg.Metadata.Get(pipeline.MetaAggregateID))
	_, err = pipeline.NewEvent(context.Background(), "a", func() {})
	require.ErrorIs(t, err, pipeline.ErrInvalidEvent)
}

func TestTraceIDFromTraceParent(t *testing.T) {
	t.Parallel()
	for tp, want := range map[string]string{
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01": "4bf92f3577b34da6a3ce929d0e0e4736",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01": "",
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01": "",
		"garbage": "",
	} {
		got, ok := pipeline.TraceIDFromTraceParent(tp)
		require.Equal(t, want, got, tp)
		require.Equal(t, want != "", ok, tp)
	}
}

func TestPermanent(t *testing.T) {
	t.Parallel()
	base := errors.New("bad payload")
	err := fmt.Errorf("decoding: %w", pipeline.Permanent(base))
	require.True(t, pipeline.IsPermanent(err))
	require.ErrorIs(t, err, base)
	require.False(t, pipeline.IsPermanent(base))
	require.NoError(t, pipeline.Permanent(nil))
}

func TestNaming(t *testing.T) {
	t.Parallel()
	require.Equal(t, "payments.charge", pipeline.RouteName(pipeline.PartitionName("payments.charge", 3)))
	require.True(t, pipeline.IsPartition("payments.charge@3"))
	require.False(t, pipeline.IsPartition("notifications.mail@w2"))
	require.False(t, pipeline.IsPartition("notifications.mail"))
	require.Equal(t, "notifications.mail", pipeline.ConsumerQueue("notifications.mail@w2"))
	require.Equal(t, "payments.charge@3", pipeline.ConsumerQueue("payments.charge@3"))
}
