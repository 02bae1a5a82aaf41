package app_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline"
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

// An outage repeats the same error or warning many times a second: the log
// writes it once per ErrorLogInterval and says how many it held back;
// other errors, and warnings about other messages, are not held.
func TestRepeatedErrorsAreThrottled(t *testing.T) {
	var buf bytes.Buffer
	logger, err := app.NewLogger(app.Config{LogFormat: "json"}, &buf)
	require.NoError(t, err)
	relay := logger.With("component", "relay")
	for i := range 79 {
		relay.Error("relay batch failed", "error", "dial tcp 127.0.0.1:5432: connection refused")
		logger.Warn("infrastructure unavailable; waiting", "message_id", fmt.Sprint("m-", i))
		relay.Warn("relay listener lost; polling until it is back", "error", "connection refused")
		logger.Warn("cannot look for a retry-now request", "handler", "ledger.post@3", "error", "connection refused")
	}
	logger.Error("another failure")
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	errors, warns := 0, 0
	for _, l := range lines {
		var line map[string]any
		require.NoError(t, json.Unmarshal(l, &line))
		switch line["level"] {
		case "ERROR":
			errors++
		case "WARN":
			warns++
		}
	}
	require.Equal(t, 2, errors, "one line per repeated error, and the other one")
	require.Equal(t, 79+2, warns, "a warning about each message is its own line; an outage's repeated warnings are one line each")
}

// The count of what was held back comes with the next line written.
func TestThrottledErrorsSayHowManyWereSuppressed(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(pipeline.ThrottleErrors(slog.NewJSONHandler(&buf, nil), 100*time.Millisecond))
	for range 5 {
		logger.Error("broker unreachable")
	}
	time.Sleep(150 * time.Millisecond)
	logger.Error("broker unreachable")
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	require.Len(t, lines, 2)
	var last map[string]any
	require.NoError(t, json.Unmarshal(lines[1], &last))
	require.EqualValues(t, 4, last["suppressed"])
}
