package pgstatus

import (
	"context"
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
