package app

import (
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/ferry-dev/ferry/pipeline"
)

// NewLogger returns the slog logger cfg asks for, writing to w (default
// stderr): JSON for machines, text when FERRY_LOG_FORMAT=text or, with
// "auto", when w is a terminal.
func NewLogger(cfg Config, w io.Writer) (*slog.Logger, error) {
	cfg = cfg.WithDefaults()
	if w == nil {
		w = os.Stderr
	}
	level, err := parseLevel(cfg.LogLevel)
	if err != nil {
		return nil, err
	}
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: readableDurations}
	format := cfg.LogFormat
	if format == "auto" {
		format = "json"
		if f, ok := w.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				format = "text"
			}
		}
	}
	// Lines logged with a message's context carry its ids (pipeline.LogHandler);
	// an error repeated by an outage is written once per ErrorLogInterval.
	var h slog.Handler = slog.NewJSONHandler(w, opts)
	if format == "text" {
		h = slog.NewTextHandler(w, opts)
	}
	return slog.New(pipeline.ThrottleErrors(pipeline.LogHandler(h), ErrorLogInterval)), nil
}

// ErrorLogInterval is how often, at most, one ERROR message is written;
// the repeats in between are counted and the next line says how many
// ("suppressed").
const ErrorLogInterval = 30 * time.Second

// readableDurations writes a duration as "30s": the JSON handler would
// write nanoseconds (30000000000), which nobody reads at 3 a.m. and no log
// query compares with the "30s" of the configuration.
func readableDurations(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}
