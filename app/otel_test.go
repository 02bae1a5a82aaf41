package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// With export on, OpenTelemetry's own errors (a collector that refuses
// spans) reach the application's log, in its format, instead of plain
// text on stderr beside it.
func TestOpenTelemetryErrorsGoToTheApplicationsLog(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
	var buf bytes.Buffer
	logger, err := app.NewLogger(app.Config{LogFormat: "json", LogLevel: "error"}, &buf)
	require.NoError(t, err)
	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), DatabaseSchema: pipelinetest.Schema(t), AdminAddr: "off"}
	none := func(app.Deps) ([]handlers.Route, error) { return nil, nil }
	a, err := app.New(context.Background(), cfg, app.Options{Logger: logger, Migrate: true, WithoutBroker: true, Routes: none})
	require.NoError(t, err)
	defer a.Close()
	otel.Handle(errors.New("traces export: connection refused"))
	var line map[string]any
	require.NoError(t, json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &line), "one JSON line: %s", buf.String())
	require.Equal(t, slog.LevelError.String(), line["level"])
	require.Contains(t, line["error"], "connection refused")
}
