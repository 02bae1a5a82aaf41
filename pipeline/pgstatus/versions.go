package pgstatus

import (
	"cmp"
	"context"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// Where an event waits, for StoredVersions and VersionSamples.
const (
	PlacePending  = pgoutbox.PlacePending
	PlaceRetry    = pgoutbox.PlaceRetry
	PlacePoison   = pgpoison.PlaceStore // in the poison store
	PlaceRelayed  = pgoutbox.PlaceRelayed
	PlaceArchived = pgoutbox.PlaceArchived
)

// StoredVersion counts the events of one topic and schema version waiting
// in one place, and says since when the oldest has.
type StoredVersion = pgoutbox.StoredVersion

// VersionSample is one stored event, for a test that decodes it.
type VersionSample = pgoutbox.VersionSample

// StoredVersions counts the events still to be read by topic, schema
// version and place (pending, retry, poison): what tells a team that no
// event of an old version is left, so that its upcast step may go.
func StoredVersions(ctx context.Context, pool *pgxpool.Pool, t pgoutbox.Table) ([]StoredVersion, error) {
	out, err := t.StoredVersions(ctx, pool)
	if err != nil {
		return nil, err
	}
	poison, err := pgpoison.StoredVersions(ctx, pool)
	if err != nil {
		return nil, err
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
	poison, err := pgpoison.VersionSamples(ctx, pool, perVersion)
	if err != nil {
		return nil, err
	}
	out = append(out, poison...)
	slices.SortFunc(out, func(a, b VersionSample) int {
		return cmp.Or(cmp.Compare(a.Topic, b.Topic), cmp.Compare(a.Version, b.Version), cmp.Compare(a.Place, b.Place), cmp.Compare(a.ID, b.ID))
	})
	return out, nil
}
