package pgstatus

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// Where an event waits, for StoredVersions and VersionSamples.
const (
	PlacePending  = "pending"  // in the outbox, not yet relayed
	PlaceRetry    = "retry"    // a durable retry waiting in the outbox
	PlacePoison   = "poison"   // in the poison store
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

// versionsSQL lists, per place, topic and schema_version, the events that
// a consumer may still have to read: pending, retrying, poisoned (a retry's
// topic is the one it was first published to). With relayed, the relayed
// and archived ones too, for a test that proves every stored event decodes.
func versionsSQL(outbox, table, archive string, relayed bool, sample int) string {
	pending := pgoutbox.PendingRows("o.*", outbox, table)
	v := `coalesce(headers->>'` + pipeline.MetaSchemaVersion + `', '')`
	payload := `COALESCE(payload_raw, convert_to(payload::text, 'UTF8'))`
	parts := []string{
		`SELECT '` + PlacePending + `' AS place, id, topic, ` + v + ` AS version, created_at AS at, ` + payload + ` AS payload FROM ` + pending +
			` o WHERE topic <> '` + pipeline.RetryTopic + `'`,
		`SELECT '` + PlaceRetry + `', id, coalesce(headers->>'` + pipeline.MetaOriginalTopic + `', topic), ` + v + `, created_at, ` + payload + ` FROM ` + pending +
			` o WHERE topic = '` + pipeline.RetryTopic + `'`,
		`SELECT '` + PlacePoison + `', id, topic, ` + v + `, poisoned_at, payload FROM ` + pgpoison.Table,
	}
	if relayed {
		parts = append(parts,
			`SELECT '`+PlaceRelayed+`', id, coalesce(headers->>'`+pipeline.MetaOriginalTopic+`', topic), `+v+`, created_at, `+payload+` FROM `+outbox+` o WHERE NOT shadowed AND `+pgoutbox.DispatchedCond("o", outbox, table),
			`SELECT '`+PlaceArchived+`', id, coalesce(headers->>'`+pipeline.MetaOriginalTopic+`', topic), `+v+`, created_at, `+payload+` FROM `+archive+` WHERE NOT shadowed`)
	}
	all := ""
	for i, p := range parts {
		if i > 0 {
			all += " UNION ALL "
		}
		all += p
	}
	if sample > 0 {
		return `SELECT place, id, topic, version, at, payload FROM (SELECT e.*, row_number() OVER (PARTITION BY place, topic, version ORDER BY id) AS n FROM (` + all + `) e) s
			WHERE n <= ` + fmt.Sprint(sample) + ` ORDER BY topic, version, place, id`
	}
	return `SELECT place, topic, version, count(*), min(at) FROM (` + all + `) e GROUP BY 1, 2, 3 ORDER BY 2, 3, 1`
}

// StoredVersions counts the events still to be read by topic, schema
// version and place (pending, retry, poison): what tells a team that no
// event of an old version is left, so that its upcast step may go.
func StoredVersions(ctx context.Context, pool *pgxpool.Pool, table string) ([]StoredVersion, error) {
	t, err := pgoutbox.QuoteTable(table)
	if err != nil {
		return nil, err
	}
	rows, err := pool.Query(ctx, versionsSQL(t, table, "", false, 0))
	if err != nil {
		return nil, fmt.Errorf("counting stored events by schema version: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[StoredVersion])
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

// VersionSamples returns up to perVersion events of every (place, topic,
// schema version) stored anywhere: pending, retrying, poisoned, relayed
// and archived.
func VersionSamples(ctx context.Context, pool *pgxpool.Pool, table string, perVersion int) ([]VersionSample, error) {
	t, err := pgoutbox.QuoteTable(table)
	if err != nil {
		return nil, err
	}
	archive, err := pgoutbox.QuoteTable(cmp.Or(table, pgoutbox.DefaultTable) + "_archive")
	if err != nil {
		return nil, err
	}
	rows, err := pool.Query(ctx, versionsSQL(t, table, archive, true, max(perVersion, 1)))
	if err != nil {
		return nil, fmt.Errorf("reading stored events by schema version: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[VersionSample])
}
