package pgpoison

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// The poison store's reads for the reports that compose several owners'
// (pgstatus's "where is this message?", an intent's state, the stored
// event versions): the store's SQL stays here.

// Reader is a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Sighting is a poisoned (or discarded) message as a search finds it.
type Sighting struct {
	ID                                               int64
	MessageID, AggregateID, Topic, Handler, Consumer string
	Headers                                          map[string]string
	Reason, CorrelationID                            string
	PoisonedAt                                       time.Time
	// Discarded: found in the archive, with when, by whom and the run that
	// undoes it.
	Discarded   bool
	DiscardedAt time.Time
	DiscardedBy string
	DiscardRun  string
}

// Search finds the messages whose message id, aggregate id or correlation
// id is q, newest first, at most limit: in the store or, archived, in the
// archive of discarded messages.
func Search(ctx context.Context, q Reader, archived bool, query string, limit int) ([]Sighting, error) {
	table, extra := Table, `, NULL::timestamptz, '', ''`
	if archived {
		table, extra = ArchiveTable, `, discarded_at, discarded_by, discard_run`
	}
	rows, err := q.Query(ctx, `SELECT id, message_id, aggregate_id, topic, handler, consumer, headers, reason, poisoned_at, correlation_id`+extra+`
		FROM `+table+` WHERE message_id = $1 OR aggregate_id = $1 OR correlation_id = $1 ORDER BY id DESC LIMIT $2`, query, limit)
	if err != nil {
		return nil, fmt.Errorf("searching the poison store: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Sighting, error) {
		s := Sighting{Discarded: archived}
		var at *time.Time
		err := row.Scan(&s.ID, &s.MessageID, &s.AggregateID, &s.Topic, &s.Handler, &s.Consumer, &s.Headers, &s.Reason, &s.PoisonedAt, &s.CorrelationID,
			&at, &s.DiscardedBy, &s.DiscardRun)
		if at != nil {
			s.DiscardedAt = *at
		}
		return s, err
	})
}

// Poisoning is one poisoning of a message.
type Poisoning struct {
	MessageID, Handler, Reason string
	At                         time.Time
}

// PoisoningsOf returns the poisonings of these messages, oldest first.
func PoisoningsOf(ctx context.Context, q Reader, messageIDs []string) ([]Poisoning, error) {
	if len(messageIDs) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `SELECT message_id, handler, reason, poisoned_at FROM `+Table+` WHERE message_id = ANY($1) ORDER BY id`, messageIDs)
	if err != nil {
		return nil, fmt.Errorf("reading poisonings: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Poisoning])
}

// PlaceStore is the place of an event in the poison store (see
// pgoutbox's places).
const PlaceStore = "poison"

// events lists the store's events as the outbox's reads list theirs
// (place, id, topic, version, at, payload).
const events = `SELECT '` + PlaceStore + `' AS place, id, topic, coalesce(headers->>'` + pipeline.MetaSchemaVersion + `', '') AS version,
	poisoned_at AS at, payload FROM ` + Table

// StoredVersions counts the store's events by topic and schema version,
// as pgoutbox.Table.StoredVersions counts the outbox's.
func StoredVersions(ctx context.Context, q Reader) ([]pgoutbox.StoredVersion, error) {
	rows, err := q.Query(ctx, `SELECT place, topic, version, count(*), min(at) FROM (`+events+`) e GROUP BY 1, 2, 3`)
	if err != nil {
		return nil, fmt.Errorf("counting poisoned events by schema version: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[pgoutbox.StoredVersion])
}

// VersionSamples returns up to perVersion of the store's events of every
// topic and schema version, as pgoutbox.Table.VersionSamples does the
// outbox's.
func VersionSamples(ctx context.Context, q Reader, perVersion int) ([]pgoutbox.VersionSample, error) {
	rows, err := q.Query(ctx, `SELECT place, id, topic, version, at, payload FROM (
		SELECT e.*, row_number() OVER (PARTITION BY topic, version ORDER BY id) AS n FROM (`+events+`) e) s
		WHERE n <= `+strconv.Itoa(max(perVersion, 1)))
	if err != nil {
		return nil, fmt.Errorf("reading poisoned events by schema version: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[pgoutbox.VersionSample])
}
