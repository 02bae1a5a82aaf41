package pipeline

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

type logAttrsKey struct{}

// ContextWithLogAttrs returns ctx carrying attrs, which every log line
// written with a *Context slog call on ctx gets (through LogHandler): the
// consumer chain puts the message id, topic, aggregate id, attempt,
// correlation and trace ids there, so a handler's own lines carry them too.
func ContextWithLogAttrs(ctx context.Context, attrs ...slog.Attr) context.Context {
	prev := LogAttrs(ctx)
	merged := make([]slog.Attr, 0, len(prev)+len(attrs))
	merged = append(append(merged, prev...), attrs...)
	return context.WithValue(ctx, logAttrsKey{}, merged)
}

// LogAttrs returns the attributes ContextWithLogAttrs put in ctx.
func LogAttrs(ctx context.Context) []slog.Attr {
	if ctx == nil {
		return nil
	}
	a, _ := ctx.Value(logAttrsKey{}).([]slog.Attr)
	return a
}

// LogHandler wraps h so that records logged with a context carry that
// context's LogAttrs.
func LogHandler(h slog.Handler) slog.Handler { return logHandler{h} }

type logHandler struct{ slog.Handler }

func (l logHandler) Handle(ctx context.Context, r slog.Record) error {
	if attrs := LogAttrs(ctx); len(attrs) > 0 {
		r = r.Clone()
		r.AddAttrs(attrs...)
	}
	return l.Handler.Handle(ctx, r)
}

func (l logHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return logHandler{l.Handler.WithAttrs(attrs)}
}

func (l logHandler) WithGroup(name string) slog.Handler { return logHandler{l.Handler.WithGroup(name)} }

type loggerKey struct{}

// ContextWithLogger returns ctx carrying logger. The consumer chain puts
// the application's logger there (the correlation link), so a middleware
// link or handler of the application logs through it, with the message's
// fields, in the application's format: Logger(msg.Context()).
func ContextWithLogger(ctx context.Context, logger *slog.Logger) context.Context {
	return context.WithValue(ctx, loggerKey{}, logger)
}

// Logger returns the logger ContextWithLogger put in ctx, or slog.Default.
func Logger(ctx context.Context) *slog.Logger {
	if ctx != nil {
		if l, ok := ctx.Value(loggerKey{}).(*slog.Logger); ok && l != nil {
			return l
		}
	}
	return slog.Default()
}

// ThrottleErrors wraps h so that a WARN or ERROR record logged less than
// interval ago with the same message about the same thing (its handler,
// consumer, message id, row id or topic attributes, when it has them) is
// counted instead of written; the next one written carries "suppressed",
// how many were counted meanwhile. An outage makes every component fail
// the same way many times a second (a held partition's look for a retry
// request, once a second each; the relay's lost listener): one line per
// cause, subject and interval says as much, without burying what else
// happens. Warnings about different messages are different lines.
func ThrottleErrors(h slog.Handler, interval time.Duration) slog.Handler {
	return &throttle{Handler: h, interval: interval, state: &throttleState{seen: map[string]*throttled{}}}
}

type throttle struct {
	slog.Handler
	interval time.Duration
	state    *throttleState
}

type throttleState struct {
	mu   sync.Mutex
	seen map[string]*throttled
}

type throttled struct {
	last       time.Time
	suppressed int
}

func (t *throttle) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn {
		return t.Handler.Handle(ctx, r)
	}
	key := throttleKey(r)
	t.state.mu.Lock()
	s := t.state.seen[key]
	if s == nil {
		if len(t.state.seen) > maxThrottledMessages {
			clear(t.state.seen) // bounded: a flood of distinct messages starts over
		}
		s = &throttled{}
		t.state.seen[key] = s
	}
	if !s.last.IsZero() && r.Time.Sub(s.last) < t.interval {
		s.suppressed++
		t.state.mu.Unlock()
		return nil
	}
	suppressed := s.suppressed
	s.last, s.suppressed = r.Time, 0
	t.state.mu.Unlock()
	if suppressed > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("suppressed", suppressed), slog.String("suppressed_over", t.interval.String()))
	}
	return t.Handler.Handle(ctx, r)
}

func (t *throttle) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &throttle{Handler: t.Handler.WithAttrs(attrs), interval: t.interval, state: t.state}
}

func (t *throttle) WithGroup(name string) slog.Handler {
	return &throttle{Handler: t.Handler.WithGroup(name), interval: t.interval, state: t.state}
}

// throttleKey is what makes two records the same line: level, message and
// the attributes that name their subject.
func throttleKey(r slog.Record) string {
	var b strings.Builder
	b.WriteString(r.Level.String())
	b.WriteByte(0)
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "handler", "consumer", "message_id", "id", "topic", "aggregate_id":
			b.WriteByte(0)
			b.WriteString(a.Key)
			b.WriteByte('=')
			b.WriteString(a.Value.String())
		}
		return true
	})
	return b.String()
}

// maxThrottledMessages bounds ThrottleErrors' memory.
const maxThrottledMessages = 1024
