// Package cutoff is the first of the three ways to adopt Ferry in a
// service that already runs: only aggregates created at or after a
// cut-off go through the outbox, older ones stay on the legacy path until
// they are done. The application asks at the fork:
//
//	if cut.Outboxed(ctx, "mail.send", order.ID, order.CreatedAt) {
//		// write the intent in the business transaction
//	} else {
//		// the legacy call, as before
//	}
//
// Each decision is counted per topic and path
// (ferry_cutoff_decisions_total{topic, path="outbox"|"legacy"}) and logged
// once per aggregate at debug level.
package cutoff

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Paths a decision takes.
const (
	PathOutbox = "outbox"
	PathLegacy = "legacy"
)

// Config says where the cut is.
type Config struct {
	// Default is the cut-off of topics without one of their own; zero means
	// such topics always go through the outbox. FERRY_CUTOFF.
	Default time.Time
	// Topics are cut-offs per topic. FERRY_CUTOFF_TOPICS
	// ("mail.send=2026-12-01T00:00:00Z,stripe.charge=…").
	Topics map[string]time.Time
}

// ParseTopics reads FERRY_CUTOFF_TOPICS's format: topic=RFC 3339 time, comma-separated.
func ParseTopics(v string) (map[string]time.Time, error) {
	out := map[string]time.Time{}
	for _, part := range strings.Split(v, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		topic, at, ok := strings.Cut(part, "=")
		if !ok || strings.TrimSpace(topic) == "" {
			return nil, fmt.Errorf("want topic=time pairs, got %q", part)
		}
		t, err := time.Parse(time.RFC3339, strings.TrimSpace(at))
		if err != nil {
			return nil, fmt.Errorf("%q: the time must be RFC 3339 (2026-12-01T00:00:00Z)", part)
		}
		out[strings.TrimSpace(topic)] = t
	}
	return out, nil
}

// String is the configuration in FERRY_CUTOFF_TOPICS's format.
func (c Config) String() string {
	keys := make([]string, 0, len(c.Topics))
	for k := range c.Topics {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + c.Topics[k].UTC().Format(time.RFC3339)
	}
	return strings.Join(parts, ",")
}

// MaxLogged bounds the aggregates remembered for logging each one's
// decision once; past it the memory starts over (an aggregate may then be
// logged again, never more than once per period).
const MaxLogged = 100_000

// Cutoff decides, per topic, whether an aggregate goes through the outbox.
// It is safe for concurrent use.
type Cutoff struct {
	cfg       Config
	logger    *slog.Logger
	decisions *prometheus.CounterVec

	mu     sync.Mutex
	logged map[string]struct{}
}

// New returns the Cutoff of cfg, counting its decisions on reg (nil: not
// registered).
func New(cfg Config, reg prometheus.Registerer, logger *slog.Logger) (*Cutoff, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	c := &Cutoff{cfg: cfg, logger: logger, logged: map[string]struct{}{},
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_cutoff_decisions_total", Help: "Cut-off decisions per topic and path (outbox or legacy).",
		}, []string{"topic", "path"})}
	if reg != nil {
		if err := reg.Register(c.decisions); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return nil, fmt.Errorf("cutoff: registering its metric: %w", err)
			}
			c.decisions = are.ExistingCollector.(*prometheus.CounterVec)
		}
	}
	return c, nil
}

// CutoffOf is topic's cut-off, and whether it has one.
func (c *Cutoff) CutoffOf(topic string) (time.Time, bool) {
	if t, ok := c.cfg.Topics[topic]; ok {
		return t, true
	}
	return c.cfg.Default, !c.cfg.Default.IsZero()
}

// Outboxed reports whether the aggregate, created at createdAt, goes
// through the outbox for topic: when it was created at or after the
// topic's cut-off, or the topic has none.
func (c *Cutoff) Outboxed(ctx context.Context, topic, aggregateID string, createdAt time.Time) bool {
	cut, has := c.CutoffOf(topic)
	outboxed := !has || !createdAt.Before(cut)
	path := PathLegacy
	if outboxed {
		path = PathOutbox
	}
	c.decisions.WithLabelValues(topic, path).Inc()
	if c.logger.Enabled(ctx, slog.LevelDebug) && c.first(topic+"\x00"+aggregateID) {
		c.logger.DebugContext(ctx, "cut-off decision", "topic", topic, "aggregate_id", aggregateID, "path", path,
			"created_at", createdAt, "cutoff", cut)
	}
	return outboxed
}

func (c *Cutoff) first(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, seen := c.logged[key]; seen {
		return false
	}
	if len(c.logged) >= MaxLogged {
		c.logged = map[string]struct{}{}
	}
	c.logged[key] = struct{}{}
	return true
}
