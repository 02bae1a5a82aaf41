package app_test

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
)

// A duration in a log line reads as the configuration writes it ("30s"),
// in JSON as in text, nested in a group too.
func TestLogDurationsAreReadable(t *testing.T) {
	for _, format := range []string{"json", "text"} {
		var buf bytes.Buffer
		logger, err := app.NewLogger(app.Config{LogFormat: format}, &buf)
		require.NoError(t, err)
		logger.Warn("relay dispatch failed", "retry_in", 90*time.Second, "count", 3)
		logger.WithGroup("budget").Info("breaker open", "window", 1500*time.Millisecond)
		require.Contains(t, buf.String(), "1m30s", format)
		require.Contains(t, buf.String(), "1.5s", format)
		require.NotContains(t, buf.String(), "90000000000", format)
		if format == "json" {
			var line map[string]any
			require.NoError(t, json.Unmarshal(bytes.SplitN(buf.Bytes(), []byte("\n"), 2)[0], &line))
			require.Equal(t, "1m30s", line["retry_in"])
			require.EqualValues(t, 3, line["count"], "other values keep their kind")
		}
	}
}
