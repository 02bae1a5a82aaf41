// Package shadow is the second way to adopt Ferry in a service that
// already runs: shadow mode (double write). The legacy code keeps
// performing the effect and records it with one call (RecordLegacy); the
// new code also writes the intent, marked shadow (pipeline.WithShadow, or
// the topic listed in FERRY_SHADOW_TOPICS), which the relay marks
// dispatched and shadowed without publishing it. Report compares the two
// sides per topic and aggregate, so the switch-over can wait until they
// agree; `ferry shadow report` exits 1 while they do not.
package shadow

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// Table holds the legacy side's effects (migration 00012).
const Table = "ferry_legacy_effects"

// RecordLegacy records that the legacy code performed topic's effect for
// aggregateID. Call it in the transaction of the legacy code's own write
// (a *sql.Tx, or a pgx transaction through pgoutbox.PgxTx), so the record
// and the legacy write agree.
func RecordLegacy(ctx context.Context, tx wsql.ContextExecutor, topic, aggregateID string) error {
	if topic == "" || aggregateID == "" {
		return errors.New("shadow: RecordLegacy needs a topic and an aggregate id")
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+Table+` (topic, aggregate_id) VALUES ($1, $2)`, topic, aggregateID); err != nil {
		return fmt.Errorf("recording the legacy effect: %w", err)
	}
	return nil
}

// MaxSample bounds the aggregate ids a report lists per side.
const MaxSample = 10

// Options select what Report compares.
type Options struct {
	// Since is how far back to look. Required.
	Since time.Duration
	// Topic restricts the report to one topic ("" for every topic seen on
	// either side).
	Topic string
	// ShadowTopics are the topics in shadow mode by configuration
	// (FERRY_SHADOW_TOPICS): all their intents count as shadow ones.
	ShadowTopics []string
	// OutboxTable is the outbox (the zero Table is the default).
	OutboxTable pgoutbox.Table
}

// TopicReport compares one topic's two sides.
type TopicReport struct {
	Topic         string `json:"topic"`
	Intents       int    `json:"intents"`        // shadow intents written (aggregates)
	LegacyEffects int    `json:"legacy_effects"` // effects the legacy code recorded (aggregates)
	Matched       int    `json:"matched"`        // aggregates on both sides
	// MissingInOutbox are aggregates the legacy code served but no shadow
	// intent covers (a sample of at most MaxSample; the count is whole).
	MissingInOutbox      []string `json:"missing_in_outbox"`
	MissingInOutboxCount int      `json:"missing_in_outbox_count"`
	// MissingInLegacy are aggregates with a shadow intent and no legacy effect.
	MissingInLegacy      []string `json:"missing_in_legacy"`
	MissingInLegacyCount int      `json:"missing_in_legacy_count"`
}

// Agree reports whether both sides cover the same aggregates.
func (t TopicReport) Agree() bool { return t.MissingInOutboxCount == 0 && t.MissingInLegacyCount == 0 }

// ReportResult is Report's answer.
type ReportResult struct {
	Since  time.Time     `json:"since"`
	Topics []TopicReport `json:"topics"`
}

// Agree reports whether every topic agrees.
func (r ReportResult) Agree() bool {
	for _, t := range r.Topics {
		if !t.Agree() {
			return false
		}
	}
	return true
}

// Report compares, per topic, the aggregates with shadow intents against
// those with recorded legacy effects over the last o.Since.
func Report(ctx context.Context, pool *pgxpool.Pool, o Options) (ReportResult, error) {
	var res ReportResult
	if o.Since <= 0 {
		return res, errors.New("shadow: Report needs a positive Since")
	}
	if o.ShadowTopics == nil {
		o.ShadowTopics = []string{}
	}
	if err := pool.QueryRow(ctx, `SELECT now() - $1 * interval '1 microsecond'`, o.Since.Microseconds()).Scan(&res.Since); err != nil {
		return res, fmt.Errorf("computing the window: %w", err)
	}
	sides, err := pgstatus.CompareShadow(ctx, pool, o.OutboxTable, Table, res.Since, o.Topic, o.ShadowTopics, MaxSample)
	if err != nil {
		return res, err
	}
	for _, t := range sides {
		res.Topics = append(res.Topics, TopicReport(t))
	}
	if res.Topics == nil {
		res.Topics = []TopicReport{}
	}
	sort.Slice(res.Topics, func(a, b int) bool { return strings.Compare(res.Topics[a].Topic, res.Topics[b].Topic) < 0 })
	return res, nil
}

// LegacyEffects counts the effects recorded over the last 24 hours, by
// topic (the ferry_legacy_effects_24h gauge).
func LegacyEffects(ctx context.Context, pool *pgxpool.Pool) (map[string]int, error) {
	rows, err := pool.Query(ctx, `SELECT topic, count(*) FROM `+Table+` WHERE recorded_at > now() - interval '24 hours' GROUP BY topic`)
	if err != nil {
		return nil, fmt.Errorf("counting legacy effects: %w", err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var topic string
		var n int
		if err := rows.Scan(&topic, &n); err != nil {
			return nil, err
		}
		out[topic] = n
	}
	return out, rows.Err()
}
