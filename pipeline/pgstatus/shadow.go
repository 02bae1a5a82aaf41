package pgstatus

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// ShadowSides compares one topic's shadow intents with the legacy code's
// recorded effects (adoption/shadow's report).
type ShadowSides struct {
	Topic                string   `json:"topic"`
	Intents              int      `json:"intents"`
	LegacyEffects        int      `json:"legacy_effects"`
	Matched              int      `json:"matched"`
	MissingInOutbox      []string `json:"missing_in_outbox"`
	MissingInOutboxCount int      `json:"missing_in_outbox_count"`
	MissingInLegacy      []string `json:"missing_in_legacy"`
	MissingInLegacyCount int      `json:"missing_in_legacy_count"`
}

// CompareShadow compares, per topic, the aggregates with shadow intents in
// the outbox table against those in legacyTable since the given time, in
// one pass inside the database (the sets themselves stay there); sample
// bounds the aggregate ids listed per side.
func CompareShadow(ctx context.Context, pool *pgxpool.Pool, outboxTable, legacyTable string, since time.Time, topic string, shadowTopics []string, sample int) ([]ShadowSides, error) {
	table, err := pgoutbox.QuoteTable(outboxTable)
	if err != nil {
		return nil, err
	}
	rows, err := pool.Query(ctx, `
		WITH intents AS (
			SELECT DISTINCT topic, aggregate_id FROM `+table+`
			WHERE created_at >= $1 AND ($2 = '' OR topic = $2) AND topic <> $4
			  AND (shadowed OR headers->>'`+pipeline.MetaShadow+`' = 'true' OR topic = ANY($3))),
		legacy AS (
			SELECT DISTINCT topic, aggregate_id FROM `+pgx.Identifier{legacyTable}.Sanitize()+`
			WHERE recorded_at >= $1 AND ($2 = '' OR topic = $2)),
		joined AS (
			SELECT coalesce(i.topic, l.topic) AS topic, coalesce(i.aggregate_id, l.aggregate_id) AS aggregate_id,
			       i.topic IS NOT NULL AS has_intent, l.topic IS NOT NULL AS has_legacy
			FROM intents i FULL JOIN legacy l ON i.topic = l.topic AND i.aggregate_id = l.aggregate_id)
		SELECT topic,
		       count(*) FILTER (WHERE has_intent), count(*) FILTER (WHERE has_legacy),
		       count(*) FILTER (WHERE has_intent AND has_legacy),
		       coalesce((array_agg(aggregate_id ORDER BY aggregate_id) FILTER (WHERE has_legacy AND NOT has_intent))[1:$5], '{}'),
		       count(*) FILTER (WHERE has_legacy AND NOT has_intent),
		       coalesce((array_agg(aggregate_id ORDER BY aggregate_id) FILTER (WHERE has_intent AND NOT has_legacy))[1:$5], '{}'),
		       count(*) FILTER (WHERE has_intent AND NOT has_legacy)
		FROM joined GROUP BY topic ORDER BY topic`,
		since, topic, shadowTopics, pipeline.RetryTopic, sample)
	if err != nil {
		return nil, fmt.Errorf("comparing shadow intents with legacy effects: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[ShadowSides])
}

// LegacyEffects counts the effects recorded in legacyTable over the last
// 24 hours, by topic (the ferry_legacy_effects_24h gauge).
func LegacyEffects(ctx context.Context, pool *pgxpool.Pool, legacyTable string) (map[string]int, error) {
	rows, err := pool.Query(ctx, `SELECT topic, count(*) FROM `+pgx.Identifier{legacyTable}.Sanitize()+` WHERE recorded_at > now() - interval '24 hours' GROUP BY topic`)
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
