package pgstatus

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// ShadowSides compares one topic's shadow intents with the legacy code's
// recorded effects (adoption/shadow's report).
type ShadowSides = pgoutbox.ShadowSides

// CompareShadow compares, per topic, the aggregates with shadow intents in
// the outbox table against those in legacyTable since the given time, in
// one pass inside the database (the sets themselves stay there); sample
// bounds the aggregate ids listed per side.
func CompareShadow(ctx context.Context, pool *pgxpool.Pool, t pgoutbox.Table, legacyTable string, since time.Time, topic string, shadowTopics []string, sample int) ([]ShadowSides, error) {
	return t.CompareShadow(ctx, pool, pgx.Identifier{legacyTable}.Sanitize(), since, topic, shadowTopics, sample)
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
