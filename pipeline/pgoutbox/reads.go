package pgoutbox

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
)

// The typed reads of the outbox: what status, the console, metrics, the
// CLI and tests ask of it, answered by its owner, so that no reader
// outside this package writes the rule of a row's state again (pgstatus
// composes these with the other owners' reads).

// TopicBacklog is one topic's pending rows.
type TopicBacklog struct {
	Topic         string  `json:"topic"`
	Pending       int     `json:"pending"`
	Due           int     `json:"due"`
	Delayed       int     `json:"delayed"`
	OldestDueAgeS float64 `json:"oldest_due_age_seconds"`
	MaxAttempts   int     `json:"max_attempts"`
}

// Backlog is the outbox's pending rows per topic, read over the slow
// lane's partial indexes and the rows the relay has not passed.
func (t Table) Backlog(ctx context.Context, q Reader) ([]TopicBacklog, error) {
	rows, err := q.Query(ctx, `SELECT topic, count(*), count(*) FILTER (WHERE available_at <= now()),
		coalesce(extract(epoch FROM now() - min(COALESCE(due_at, created_at)) FILTER (WHERE available_at <= now())), 0)::float8, max(attempts)
		FROM `+t.pendingRows("o.*")+` o GROUP BY topic ORDER BY topic`)
	if err != nil {
		return nil, fmt.Errorf("reading the outbox backlog: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (TopicBacklog, error) {
		var b TopicBacklog
		err := row.Scan(&b.Topic, &b.Pending, &b.Due, &b.OldestDueAgeS, &b.MaxAttempts)
		b.Delayed = b.Pending - b.Due
		return b, err
	})
}

// PendingFilter narrows CountPending.
type PendingFilter struct {
	// Topic, if set, counts only this topic's rows.
	Topic string
	// Due counts only rows due now (available_at passed).
	Due bool
}

// CountPending counts the pending rows that f selects.
func (t Table) CountPending(ctx context.Context, q Reader, f PendingFilter) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, `SELECT count(*) FROM `+t.pendingRows("o.topic, o.available_at")+` p
		WHERE ($1 = '' OR p.topic = $1) AND (NOT $2 OR p.available_at <= now())`, f.Topic, f.Due).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("counting pending outbox rows: %w", err)
	}
	return n, nil
}

// TriedRow is a pending row the relay tried more than a threshold.
type TriedRow struct {
	ID          int64     `json:"id"`
	Topic       string    `json:"topic"`
	AggregateID string    `json:"aggregate_id"`
	Attempts    int       `json:"attempts"`
	LastError   string    `json:"last_error"`
	AvailableAt time.Time `json:"available_at"`
	CreatedAt   time.Time `json:"created_at"`
}

// MostTried lists at most limit failing rows (StateFailing: the one rule
// of "failing" that status, the console, the view and the metrics share)
// tried more than threshold times, most tried first.
func (t Table) MostTried(ctx context.Context, q Reader, threshold, limit int) ([]TriedRow, error) {
	rows, err := q.Query(ctx, `SELECT id, topic, aggregate_id, attempts, coalesce(last_error, ''), available_at, created_at
		FROM `+t.pendingRows("o.*")+` o WHERE `+failingRule+` AND attempts > $1 ORDER BY attempts DESC, id LIMIT $2`, threshold, limit)
	if err != nil {
		return nil, fmt.Errorf("reading failing rows: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[TriedRow])
}

// CountFailing counts the failing rows (StateFailing): pending rows the
// relay tried to publish and could not. The console's overview and
// failing page, ferry status and the operator view ferry_outbox_failing
// all count by this one rule.
func (t Table) CountFailing(ctx context.Context, q Reader) (int, error) {
	var n int
	if err := q.QueryRow(ctx, `SELECT count(*) FROM `+t.pendingRows("o.*")+` o WHERE `+failingRule).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting failing outbox rows: %w", err)
	}
	return n, nil
}

// RetryGroup is the durable retries waiting for one handler with one
// error fingerprint: messages a handler failed, rescheduled through the
// outbox (topic ferry.retry) to be delivered to it again.
type RetryGroup struct {
	Handler     string    `json:"handler"`
	Fingerprint string    `json:"fingerprint"`
	Count       int       `json:"count"`
	MaxAttempt  int       `json:"max_next_attempt"`
	NextTry     time.Time `json:"next_try"`
	FirstFailed time.Time `json:"first_failed_at"`
	Example     string    `json:"example_error"`
}

// RetryGroups returns the durable retries waiting in the outbox, grouped
// by handler and error fingerprint (most first, at most limit groups),
// and their total.
func (t Table) RetryGroups(ctx context.Context, q Reader, limit int) ([]RetryGroup, int, error) {
	h := func(k string) string { return `headers->>'` + k + `'` }
	rows, err := q.Query(ctx, `SELECT coalesce(`+h(pipeline.MetaRetryQueue)+`, ''), ferry_fingerprint(`+h(pipeline.MetaLastError)+`), count(*),
		max(CASE WHEN `+h(pipeline.MetaAttempt)+` ~ '^[0-9]{1,9}$' THEN (`+h(pipeline.MetaAttempt)+`)::int ELSE 0 END),
		min(available_at), min(coalesce(CASE WHEN `+h(pipeline.MetaFirstFailedAt)+` ~ '^\d{4}-' THEN (`+h(pipeline.MetaFirstFailedAt)+`)::timestamptz END, created_at)),
		coalesce((array_agg(`+h(pipeline.MetaLastError)+` ORDER BY id DESC))[1], ''), sum(count(*)) OVER ()
		FROM `+t.pendingRows("o.*")+` o WHERE topic = $1 GROUP BY 1, 2 ORDER BY 3 DESC, 1 LIMIT $2`, pipeline.RetryTopic, limit)
	if err != nil {
		return nil, 0, fmt.Errorf("reading durable retries: %w", err)
	}
	total := 0
	groups, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (RetryGroup, error) {
		var g RetryGroup
		var all int64
		err := row.Scan(&g.Handler, &g.Fingerprint, &g.Count, &g.MaxAttempt, &g.NextTry, &g.FirstFailed, &g.Example, &all)
		total = int(all)
		return g, err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("reading durable retries: %w", err)
	}
	return groups, total, nil
}

// Where a stored event waits (StoredVersion.Place).
const (
	PlacePending  = "pending"  // in the outbox, not yet relayed
	PlaceRetry    = "retry"    // a durable retry waiting in the outbox
	PlaceRelayed  = "relayed"  // relayed, kept in the outbox until retention
	PlaceArchived = "archived" // in the outbox archive
)

// StoredVersion counts the events of one topic and schema version waiting
// in one place, and says since when the oldest has.
type StoredVersion struct {
	Place   string    `json:"place"`
	Topic   string    `json:"topic"`
	Version string    `json:"schema_version"`
	Count   int       `json:"count"`
	Oldest  time.Time `json:"oldest"`
}

// VersionSample is one stored event, for a test that decodes it.
type VersionSample struct {
	Place   string
	ID      int64
	Topic   string
	Version string
	At      time.Time
	Payload []byte
}

// storedEvents lists (place, id, topic, version, at, payload) of the
// events a consumer may still have to read: pending and retrying (a
// retry's topic is the one it was first published to); with relayed, the
// relayed and archived ones too.
func (t Table) storedEvents(relayed bool) string {
	pending := t.pendingRows("o.*")
	v := `coalesce(headers->>'` + pipeline.MetaSchemaVersion + `', '')`
	payload := `COALESCE(payload_raw, convert_to(payload::text, 'UTF8'))`
	origTopic := `coalesce(headers->>'` + pipeline.MetaOriginalTopic + `', topic)`
	parts := []string{
		`SELECT '` + PlacePending + `' AS place, id, topic, ` + v + ` AS version, created_at AS at, ` + payload + ` AS payload FROM ` + pending +
			` o WHERE topic <> '` + pipeline.RetryTopic + `'`,
		`SELECT '` + PlaceRetry + `', id, ` + origTopic + `, ` + v + `, created_at, ` + payload + ` FROM ` + pending +
			` o WHERE topic = '` + pipeline.RetryTopic + `'`,
	}
	if relayed {
		parts = append(parts,
			`SELECT '`+PlaceRelayed+`', id, `+origTopic+`, `+v+`, created_at, `+payload+` FROM `+t.Quoted()+` o WHERE NOT shadowed AND `+t.dispatchedCond("o"),
			`SELECT '`+PlaceArchived+`', id, `+origTopic+`, `+v+`, created_at, `+payload+` FROM `+t.Archive()+` WHERE NOT shadowed`)
	}
	return strings.Join(parts, " UNION ALL ")
}

// StoredVersions counts the events still to be read (pending, retrying)
// by place, topic and schema version: what tells a team that no event of
// an old version is left, so that its upcast step may go.
func (t Table) StoredVersions(ctx context.Context, q Reader) ([]StoredVersion, error) {
	rows, err := q.Query(ctx, `SELECT place, topic, version, count(*), min(at) FROM (`+t.storedEvents(false)+`) e GROUP BY 1, 2, 3 ORDER BY 2, 3, 1`)
	if err != nil {
		return nil, fmt.Errorf("counting stored events by schema version: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[StoredVersion])
}

// VersionSamples returns up to perVersion events of every (place, topic,
// schema version) the outbox and its archive keep: pending, retrying,
// relayed and archived.
func (t Table) VersionSamples(ctx context.Context, q Reader, perVersion int) ([]VersionSample, error) {
	rows, err := q.Query(ctx, `SELECT place, id, topic, version, at, payload FROM (
		SELECT e.*, row_number() OVER (PARTITION BY place, topic, version ORDER BY id) AS n FROM (`+t.storedEvents(true)+`) e) s
		WHERE n <= `+strconv.Itoa(max(perVersion, 1))+` ORDER BY topic, version, place, id`)
	if err != nil {
		return nil, fmt.Errorf("reading stored events by schema version: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[VersionSample])
}
