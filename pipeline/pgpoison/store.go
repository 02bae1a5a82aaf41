package pgpoison

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgfilter"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Record is one poisoned message.
type Record struct {
	ID            int64             `json:"id"`
	MessageID     string            `json:"message_id"`
	Topic         string            `json:"topic"`
	Handler       string            `json:"handler"`
	Consumer      string            `json:"consumer"`
	AggregateID   string            `json:"aggregate_id"`
	Payload       []byte            `json:"-"`
	PayloadText   string            `json:"payload"`
	Headers       map[string]string `json:"headers"`
	Reason        string            `json:"reason"`
	Permanent     bool              `json:"permanent"`
	Attempts      int               `json:"attempts"`
	FirstFailedAt time.Time         `json:"first_failed_at"`
	LastFailedAt  time.Time         `json:"last_failed_at"`
	PoisonedAt    time.Time         `json:"poisoned_at"`
	CorrelationID string            `json:"correlation_id"`
	// Fingerprint is the reason's group (see Filter.Fingerprint).
	Fingerprint string `json:"fingerprint"`
}

// jsonValueHeaders are headers whose value is JSON: --json output and the
// API show them as JSON, not as strings holding JSON.
var jsonValueHeaders = []string{pipeline.MetaErrorHistory}

// MarshalJSON writes r with its payload as a JSON value when it is JSON
// (as text otherwise), and the headers that hold JSON (the error history)
// as JSON values: a reader of `poison list --json` gets data, not strings
// to decode again.
func (r Record) MarshalJSON() ([]byte, error) {
	type plain Record
	out := struct {
		plain
		Payload any            `json:"payload"`
		Headers map[string]any `json:"headers"`
	}{plain: plain(r), Payload: r.PayloadText}
	if json.Valid(r.Payload) {
		out.Payload = json.RawMessage(r.Payload)
	}
	out.Headers = make(map[string]any, len(r.Headers))
	for k, v := range r.Headers {
		if slices.Contains(jsonValueHeaders, k) && json.Valid([]byte(v)) {
			out.Headers[k] = json.RawMessage(v)
		} else {
			out.Headers[k] = v
		}
	}
	return json.Marshal(out)
}

// Selector chooses poisoned messages: exactly one of IDs, Topic, a Filter
// or All, oldest first.
type Selector struct {
	IDs   []int64
	Topic string
	All   bool
	// Filter chooses by handler, aggregate, text, group or time (its Topic
	// works like Selector.Topic; its AfterID and Limit are ignored).
	Filter Filter
	// AfterID starts after this poison id: the next page of an earlier run.
	AfterID int64
	// Limit caps how many are chosen (oldest first); 0 means no cap.
	Limit int
}

// MaxLimit bounds Selector.Limit and Filter.Limit.
const MaxLimit = pgfilter.MaxLimit

// pageSize is how many records one transaction takes: memory and lock
// time stay flat however many messages a command selects.
const pageSize = 500

// ErrNotFound is returned by Get for an id the store does not hold.
var ErrNotFound = errors.New("no such poisoned message")

// Validate rejects a selector that names nothing, or more than one thing.
func (s Selector) Validate() error {
	n := 0
	if len(s.IDs) > 0 {
		n++
	}
	if s.Topic != "" || s.Filter.Narrows() {
		n++
	}
	if s.All {
		n++
	}
	if n != 1 {
		return errors.New("select the messages with exactly one of --id, --topic/--filter or --all")
	}
	return Filter{AfterID: s.AfterID, Limit: s.Limit}.Validate()
}

// Filter chooses poisoned messages to read, oldest first (see pgfilter).
type Filter = pgfilter.Filter

// Columns name what a Filter's criteria compare in a table.
type Columns = pgfilter.Columns

// PoisonColumns are the poison store's.
var PoisonColumns = Columns{Topic: "topic", Handler: "handler", AggregateID: "aggregate_id", Text: "reason",
	Fingerprint: "fingerprint", Time: "poisoned_at", CorrelationID: "correlation_id", MessageID: "message_id",
	Tenant: "headers->>'" + pipeline.MetaTenantID + "'"}

// where is f's criteria over poison_messages.
func where(f Filter, first int) (string, []any) { return f.SQL(first, PoisonColumns) }

// Store reads and acts on the poison store.
type Store struct {
	pool   *pgxpool.Pool
	outbox *pgoutbox.Outbox
}

// NewStore returns the store over pool, requeueing through outbox (the one
// INSERT path into the outbox).
func NewStore(pool *pgxpool.Pool, outbox *pgoutbox.Outbox) (*Store, error) {
	if pool == nil || outbox == nil {
		return nil, errors.New("pgpoison: NewStore needs a pool and an outbox")
	}
	return &Store{pool: pool, outbox: outbox}, nil
}

const columns = `id, message_id, topic, handler, consumer, aggregate_id, payload, headers, reason, permanent,
	attempts, first_failed_at, last_failed_at, poisoned_at, correlation_id, coalesce(fingerprint, '')`

func scanRecords(rows pgx.Rows) ([]Record, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) {
		var r Record
		err := row.Scan(&r.ID, &r.MessageID, &r.Topic, &r.Handler, &r.Consumer, &r.AggregateID, &r.Payload, &r.Headers,
			&r.Reason, &r.Permanent, &r.Attempts, &r.FirstFailedAt, &r.LastFailedAt, &r.PoisonedAt, &r.CorrelationID, &r.Fingerprint)
		r.PayloadText = string(r.Payload)
		return r, err
	})
}

// Pool is the store's database pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// List returns poisoned messages, oldest first, of topic (all when empty),
// at most limit (all when 0). For large stores use Each, which pages.
func (s *Store) List(ctx context.Context, topic string, limit int) ([]Record, error) {
	var out []Record
	err := s.Each(ctx, Filter{Topic: topic, Limit: limit}, func(r Record) error {
		out = append(out, r)
		return nil
	})
	return out, err
}

// Each calls fn for every poisoned message f chooses, oldest first, reading
// a page at a time (by id), so memory stays flat at any store size. fn's
// error stops the walk and is returned.
func (s *Store) Each(ctx context.Context, f Filter, fn func(Record) error) error {
	if err := f.Validate(); err != nil {
		return err
	}
	after, seen := f.AfterID, 0
	for {
		n := pageSize
		if f.Limit > 0 {
			n = min(n, f.Limit-seen)
		}
		if n <= 0 {
			return nil
		}
		where, args := where(f, 3)
		rows, err := s.pool.Query(ctx, `SELECT `+columns+` FROM `+Table+`
			WHERE id > $1 AND `+where+` ORDER BY id LIMIT $2`, append([]any{after, n}, args...)...)
		if err != nil {
			return fmt.Errorf("listing poisoned messages: %w", err)
		}
		recs, err := scanRecords(rows)
		if err != nil {
			return fmt.Errorf("reading poisoned messages: %w", err)
		}
		for _, r := range recs {
			if err := fn(r); err != nil {
				return err
			}
			after = r.ID
		}
		seen += len(recs)
		if len(recs) < n {
			return nil
		}
	}
}

// Page is one page of poisoned messages, newest first, for a reader who
// pages back and forth (the console).
type Page struct {
	Records []Record
	// Older and Newer say whether messages under the filter lie beyond
	// the page: older ones (ids below its last) and newer ones (above its
	// first).
	Older, Newer bool
}

// PageOf returns up to limit messages f chooses (its AfterID and Limit
// ignored), newest first: the newest when before and after are 0, those
// just older than id before, or those just newer than id after.
func (s *Store) PageOf(ctx context.Context, f Filter, before, after int64, limit int) (Page, error) {
	var p Page
	if limit <= 0 || before < 0 || after < 0 || (before > 0 && after > 0) {
		return p, errors.New("pgpoison: PageOf needs a positive limit and at most one of before and after")
	}
	where, args := where(f, 3)
	q := `SELECT ` + columns + ` FROM ` + Table + ` WHERE ($1 = 0 OR id < $1) AND ` + where + ` ORDER BY id DESC LIMIT $2`
	bound := before
	if after > 0 {
		q = `SELECT ` + columns + ` FROM ` + Table + ` WHERE id > $1 AND ` + where + ` ORDER BY id LIMIT $2`
		bound = after
	}
	rows, err := s.pool.Query(ctx, q, append([]any{bound, limit + 1}, args...)...)
	if err != nil {
		return p, fmt.Errorf("listing poisoned messages: %w", err)
	}
	recs, err := scanRecords(rows)
	if err != nil {
		return p, fmt.Errorf("reading poisoned messages: %w", err)
	}
	more := len(recs) > limit
	if more {
		recs = recs[:limit]
	}
	if after > 0 {
		slices.Reverse(recs)
		p.Newer, p.Older = more, true
	} else {
		p.Older, p.Newer = more, before > 0
	}
	p.Records = recs
	if len(recs) == 0 {
		// Past either end: say whether anything lies the other way.
		p.Older, p.Newer = after > 0, before > 0
	}
	return p, nil
}

// Count counts the poisoned messages f chooses (its AfterID and Limit
// ignored).
func (s *Store) Count(ctx context.Context, f Filter) (int, error) {
	where, args := where(f, 1)
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+Table+` WHERE `+where, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting poisoned messages: %w", err)
	}
	return n, nil
}

// Group is the poisoned messages of one error fingerprint.
type Group struct {
	Fingerprint string    `json:"fingerprint"`
	Count       int       `json:"count"`
	FirstSeen   time.Time `json:"first_seen"`
	LastSeen    time.Time `json:"last_seen"`
	// Example is the newest message's reason.
	Example  string `json:"example"`
	Handlers string `json:"handlers"`
	Topics   string `json:"topics"`
}

// Groups groups the messages f chooses by error fingerprint, the biggest
// first, at most limit groups (0: all). It reads over the fingerprint index.
func (s *Store) Groups(ctx context.Context, f Filter, limit int) ([]Group, error) {
	where, args := where(f, 2)
	rows, err := s.pool.Query(ctx, `SELECT fingerprint, count(*), min(poisoned_at), max(poisoned_at),
		(array_agg(reason ORDER BY id DESC))[1], string_agg(DISTINCT handler, ', '), string_agg(DISTINCT topic, ', ')
		FROM `+Table+` WHERE `+where+` GROUP BY fingerprint ORDER BY 2 DESC, 1 LIMIT NULLIF($1, 0)`, append([]any{limit}, args...)...)
	if err != nil {
		return nil, fmt.Errorf("grouping poisoned messages: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Group])
}

// Get returns one poisoned message, or ErrNotFound.
func (s *Store) Get(ctx context.Context, id int64) (Record, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+columns+` FROM `+Table+` WHERE id = $1`, id)
	if err != nil {
		return Record{}, fmt.Errorf("reading poisoned message %d: %w", id, err)
	}
	recs, err := scanRecords(rows)
	if err != nil {
		return Record{}, fmt.Errorf("reading poisoned message %d: %w", id, err)
	}
	if len(recs) == 0 {
		return Record{}, fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	return recs[0], nil
}

// Depth counts poisoned messages per topic.
func (s *Store) Depth(ctx context.Context) (map[string]int, error) { return Depth(ctx, s.pool) }

// Since returns the newest poison id and how many messages were poisoned
// after afterID (all of them for 0): what `ferry status --acknowledge`
// records and what is new since.
func Since(ctx context.Context, pool *pgxpool.Pool, afterID int64) (maxID int64, newer int, err error) {
	err = pool.QueryRow(ctx, `SELECT coalesce(max(id), 0), count(*) FILTER (WHERE id > $1) FROM `+Table, afterID).Scan(&maxID, &newer)
	if err != nil {
		return 0, 0, fmt.Errorf("reading the poison store: %w", err)
	}
	return maxID, newer, nil
}

// Depth counts the poisoned messages in pool's store, per original topic.
func Depth(ctx context.Context, pool *pgxpool.Pool) (map[string]int, error) {
	rows, err := pool.Query(ctx, `SELECT topic, count(*) FROM `+Table+` GROUP BY topic`)
	if err != nil {
		return nil, fmt.Errorf("counting poisoned messages: %w", err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var t string
		var n int
		if err := rows.Scan(&t, &n); err != nil {
			return nil, err
		}
		out[t] = n
	}
	return out, rows.Err()
}

// NotPoisoned returns the ids of messageIDs that handler has not
// poisoned, in their order (see pgledger's Unprocessed: together they say
// which sent messages a handler has not dealt with yet).
func NotPoisoned(ctx context.Context, pool *pgxpool.Pool, handler string, messageIDs []string) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT m.id FROM unnest($2::text[]) WITH ORDINALITY AS m(id, n)
		WHERE NOT EXISTS (SELECT 1 FROM `+Table+` x WHERE x.handler = $1 AND x.message_id = m.id) ORDER BY m.n`, handler, messageIDs)
	if err != nil {
		return nil, fmt.Errorf("looking up %d message(s) in the poison store of %s: %w", len(messageIDs), handler, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ArchiveTable keeps discarded messages (migration 00023) for Undo.
const ArchiveTable = "ferry_poison_archive"

// archived are the columns a discard keeps (the fingerprint is computed).
const archived = `id, message_id, topic, handler, consumer, aggregate_id, payload, headers, reason, permanent,
	attempts, first_failed_at, last_failed_at, poisoned_at, correlation_id`

// HandlerCount is how many poisoned messages one handler gave up on.
type HandlerCount struct {
	Name  string
	Count int
}

// CountByHandler counts the poisoned messages per handler, most first.
func (s *Store) CountByHandler(ctx context.Context) ([]HandlerCount, error) {
	rows, err := s.pool.Query(ctx, `SELECT handler, count(*) FROM `+Table+` GROUP BY handler ORDER BY 2 DESC, 1`)
	if err != nil {
		return nil, fmt.Errorf("counting poisoned messages per handler: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[HandlerCount])
}
