package pgstatus

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// Where an event waits, for StoredVersions and VersionSamples.
const (
	PlacePending  = pgoutbox.PlacePending
	PlaceRetry    = pgoutbox.PlaceRetry
	PlacePoison   = "poison" // in the poison store
	PlaceRelayed  = pgoutbox.PlaceRelayed
	PlaceArchived = pgoutbox.PlaceArchived
)

// StoredVersion counts the events of one topic and schema version waiting
// in one place, and says since when the oldest has.
type StoredVersion = pgoutbox.StoredVersion

// VersionSample is one stored event, for a test that decodes it.
type VersionSample = pgoutbox.VersionSample

// poisonEvents lists the poison store's events as the outbox's reads list
// theirs (place, id, topic, version, at, payload).
const poisonEvents = `SELECT '` + PlacePoison + `' AS place, id, topic, coalesce(headers->>'` + pipeline.MetaSchemaVersion + `', '') AS version,
	poisoned_at AS at, payload FROM ` + pgpoison.Table

// StoredVersions counts the events still to be read by topic, schema
// version and place (pending, retry, poison): what tells a team that no
// event of an old version is left, so that its upcast step may go.
func StoredVersions(ctx context.Context, pool *pgxpool.Pool, t pgoutbox.Table) ([]StoredVersion, error) {
	out, err := t.StoredVersions(ctx, pool)
	if err != nil {
		return nil, err
	}
	rows, err := pool.Query(ctx, `SELECT place, topic, version, count(*), min(at) FROM (`+poisonEvents+`) e GROUP BY 1, 2, 3`)
	if err != nil {
		return nil, fmt.Errorf("counting poisoned events by schema version: %w", err)
	}
	poison, err := pgx.CollectRows(rows, pgx.RowToStructByPos[StoredVersion])
	if err != nil {
		return nil, fmt.Errorf("counting poisoned events by schema version: %w", err)
	}
	out = append(out, poison...)
	slices.SortFunc(out, func(a, b StoredVersion) int {
		return cmp.Or(cmp.Compare(a.Topic, b.Topic), cmp.Compare(a.Version, b.Version), cmp.Compare(a.Place, b.Place))
	})
	return out, nil
}

// VersionSamples returns up to perVersion events of every (place, topic,
// schema version) stored anywhere: pending, retrying, poisoned, relayed
// and archived.
func VersionSamples(ctx context.Context, pool *pgxpool.Pool, t pgoutbox.Table, perVersion int) ([]VersionSample, error) {
	out, err := t.VersionSamples(ctx, pool, perVersion)
	if err != nil {
		return nil, err
	}
	rows, err := pool.Query(ctx, `SELECT place, id, topic, version, at, payload FROM (
		SELECT e.*, row_number() OVER (PARTITION BY topic, version ORDER BY id) AS n FROM (`+poisonEvents+`) e) s
		WHERE n <= `+strconv.Itoa(max(perVersion, 1)))
	if err != nil {
		return nil, fmt.Errorf("reading poisoned events by schema version: %w", err)
	}
	poison, err := pgx.CollectRows(rows, pgx.RowToStructByPos[VersionSample])
	if err != nil {
		return nil, fmt.Errorf("reading poisoned events by schema version: %w", err)
	}
	out = append(out, poison...)
	slices.SortFunc(out, func(a, b VersionSample) int {
		return cmp.Or(cmp.Compare(a.Topic, b.Topic), cmp.Compare(a.Version, b.Version), cmp.Compare(a.Place, b.Place), cmp.Compare(a.ID, b.ID))
	})
	return out, nil
}
