package pipeline_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
)

func TestLogHandlerAddsContextAttrs(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	logger := slog.New(pipeline.LogHandler(slog.NewJSONHandler(&buf, nil))).With("component", "test")
	ctx := pipeline.ContextWithLogAttrs(context.Background(), slog.String("message_id", "42"))
	ctx = pipeline.ContextWithLogAttrs(ctx, slog.String("trace_id", "abc"))
	logger.InfoContext(ctx, "handled", "order_id", 7)
	logger.Info("no context")

	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	require.Len(t, lines, 2)
	var first, second map[string]any
	require.NoError(t, json.Unmarshal(lines[0], &first))
	require.NoError(t, json.Unmarshal(lines[1], &second))
	require.Equal(t, "42", first["message_id"])
	require.Equal(t, "abc", first["trace_id"])
	require.Equal(t, "test", first["component"])
	require.EqualValues(t, 7, first["order_id"])
	require.NotContains(t, second, "message_id")
}
