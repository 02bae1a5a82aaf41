package pgpoison

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/internal/republish"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
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
	// MaxID, if set, chooses no message stored after it: an action
	// confirmed on what a page showed takes none that arrived since.
	MaxID int64
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
	Fingerprint: "fingerprint", Time: "poisoned_at", CorrelationID: "correlation_id", MessageID: "message_id"}

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

// CountIDs counts how many of ids the store holds.
func (s *Store) CountIDs(ctx context.Context, ids []int64) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+Table+` WHERE id = ANY($1)`, ids).Scan(&n); err != nil {
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

// Action is what Requeue or Discard did (or, dry, would do) with one message.
type Action struct {
	Record Record `json:"record"`
	// Done is false for a message left in the store; Why says why.
	Done bool   `json:"done"`
	Why  string `json:"why,omitempty"`
	// MessageID is the requeued message's id: the UUID of its new outbox row.
	MessageID string `json:"message_id,omitempty"`
}

// Summary counts what Requeue or Discard did.
type Summary struct {
	Done    int  `json:"done"`
	Skipped int  `json:"skipped"`
	DryRun  bool `json:"dry_run"`
	// NotFound are the ids of Selector.IDs the store does not hold.
	NotFound []int64 `json:"not_found"`
	// LastID is the last poison id looked at: Selector.AfterID of a next run.
	LastID int64 `json:"last_id"`
	// Run names this run (Run.ID, or one made up): a discard's messages are
	// archived under it, and Undo puts them back by it.
	Run string `json:"run,omitempty"`
}

// Skipped is a message Requeue left in the store, and why.
type Skipped struct {
	Record Record `json:"record"`
	Why    string `json:"why"`
}

// RequeueResult says what Requeue did (or, dry, would do).
type RequeueResult struct {
	Requeued []Record  `json:"requeued"`
	Skipped  []Skipped `json:"skipped"`
	// MessageIDs are the requeued messages' ids: the UUIDs of the new
	// outbox rows (message_uuid), one per requeued message.
	MessageIDs []string `json:"message_ids"`
	NotFound   []int64  `json:"not_found"`
	DryRun     bool     `json:"dry_run"`
}

// Run says how Requeue and Discard act: for real or dry, and on whose
// behalf.
type Run struct {
	// DryRun takes every step and rolls it back.
	DryRun bool
	// Actor names who acts (pgaudit.CLIActor, "console <identity>"): every
	// page of a real run records an audit entry, with the ids it acted on,
	// in the page's own transaction. Required unless DryRun.
	Actor string
	// Scope says what the operator chose, for the audit entry; the
	// selector's own words when empty.
	Scope string
	// ID names the run; empty, one is made up. A discard archives its
	// messages under it (ferry_poison_archive), so that Undo can put the
	// whole run back; each page's audit entry records it.
	ID string
	// Confirmation, if set, is the single-use nonce of the confirmation
	// this run acts on (the console's): recorded with the first page's
	// audit entry, a second run with it fails with
	// pgaudit.ErrConfirmationUsed and changes nothing.
	Confirmation string
}

// Scope is sel in words, for the audit log.
func (sel Selector) Scope() string {
	switch {
	case len(sel.IDs) > 0:
		ids := make([]string, len(sel.IDs))
		for i, id := range sel.IDs {
			ids[i] = fmt.Sprint(id)
		}
		return "ids " + strings.Join(ids, ",")
	case sel.All:
		return "all"
	}
	f := sel.Filter
	if sel.Topic != "" {
		f.Topic = sel.Topic
	}
	return "filter " + f.String()
}

// Requeue is RequeueEach collecting every action: for selections a
// command line makes, use RequeueEach, which streams.
func (s *Store) Requeue(ctx context.Context, sel Selector, run Run) (RequeueResult, error) {
	dryRun := run.DryRun
	res := RequeueResult{DryRun: dryRun}
	sum, err := s.RequeueEach(ctx, sel, run, func(a Action) error {
		if a.Done {
			res.Requeued = append(res.Requeued, a.Record)
			if !dryRun {
				res.MessageIDs = append(res.MessageIDs, a.MessageID)
			}
		} else {
			res.Skipped = append(res.Skipped, Skipped{Record: a.Record, Why: a.Why})
		}
		return nil
	})
	res.NotFound = sum.NotFound
	return res, err
}

// RequeueEach sends the selected messages back to their original topic: it
// writes each into the outbox (message id kept, attempt count reset,
// failure bookkeeping dropped) and deletes it here, in one transaction per
// page of messages, so an interrupted requeue loses and doubles nothing.
// Handlers that had already processed the message skip it through their
// ledger; the one that failed runs it. Payloads go back byte for byte.
//
// A message that cannot be written back (no id, no topic, headers the
// outbox refuses) is skipped with the reason, under a savepoint of its own,
// and the rest go on. A dry run takes exactly the same steps and rolls
// everything back, so it reports the same skips. fn is told each action as
// its page commits (a dry run's as it is tried).
func (s *Store) RequeueEach(ctx context.Context, sel Selector, run Run, fn func(Action) error) (Summary, error) {
	return s.act(ctx, sel, run, "poison.requeue", fn, func(ctx context.Context, tx pgx.Tx, r Record) (string, error) {
		headers := map[string]string{}
		for k, v := range r.Headers {
			if !slices.Contains(bookkeeping, k) {
				headers[k] = v
			}
		}
		headers[pipeline.MetaMessageID] = r.MessageID
		headers["ferry_requeued_from_poison_id"] = fmt.Sprint(r.ID)
		// The same message again: its UUID is its id, as at first.
		msg := message.NewMessage(r.MessageID, r.Payload)
		for k, v := range headers {
			msg.Metadata.Set(k, v)
		}
		msg.Metadata.Set(pipeline.MetaAggregateID, r.AggregateID)
		if err := s.outbox.PublishTx(republish.Context(ctx), pgoutbox.PgxTx(tx), r.Topic, msg); err != nil {
			return "", fmt.Errorf("cannot be written back into the outbox: %w", err)
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+Table+` WHERE id = $1`, r.ID); err != nil {
			return "", fmt.Errorf("removing requeued message: %w", err)
		}
		return r.MessageID, nil
	})
}

// DiscardEach moves the selected messages (or, dry, only says which) out
// of the store into its archive (ArchiveTable), under the run's id, a page
// per transaction, telling fn each: Undo puts a run back until retention
// (pgretention.PoisonArchive) removes it.
func (s *Store) DiscardEach(ctx context.Context, sel Selector, run Run, fn func(Action) error) (Summary, error) {
	run = run.named()
	return s.actPages(ctx, sel, run, "poison.discard", fn, func(ctx context.Context, tx pgx.Tx, recs []Record) ([]Action, error) {
		// One statement per page: a discard cannot fail for one message
		// alone, and 200,000 of them take seconds, not minutes.
		ids := make([]int64, len(recs))
		for i, r := range recs {
			ids[i] = r.ID
		}
		rows, err := tx.Query(ctx, `WITH gone AS (DELETE FROM `+Table+` WHERE id = ANY($1) RETURNING `+archived+`)
			INSERT INTO `+ArchiveTable+` (`+archived+`, discarded_by, discard_run) SELECT `+archived+`, $2, $3 FROM gone RETURNING id`, ids, run.Actor, run.ID)
		if err != nil {
			return nil, fmt.Errorf("discarding: %w", err)
		}
		gone := map[int64]bool{}
		var id int64
		if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { gone[id] = true; return nil }); err != nil {
			return nil, fmt.Errorf("discarding: %w", err)
		}
		actions := make([]Action, len(recs))
		for i, r := range recs {
			actions[i] = Action{Record: r, Done: gone[r.ID]}
			if !actions[i].Done {
				actions[i].Why = "no longer in the store"
			}
		}
		return actions, nil
	})
}

// ArchiveTable keeps discarded messages (migration 00023) for Undo.
const ArchiveTable = "ferry_poison_archive"

// archived are the columns a discard keeps (the fingerprint is computed).
const archived = `id, message_id, topic, handler, consumer, aggregate_id, payload, headers, reason, permanent,
	attempts, first_failed_at, last_failed_at, poisoned_at, correlation_id`

// named is run with an id.
func (run Run) named() Run {
	if run.ID == "" {
		b := make([]byte, 8)
		_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
		run.ID = hex.EncodeToString(b)
	}
	return run
}

// UndoResult says what Undo put back.
type UndoResult struct {
	Run string `json:"run"`
	// Restored are the poison ids back in the store, with their ids.
	Restored []int64 `json:"restored"`
}

// ErrNothingToUndo is returned by Undo for a run whose messages are not in
// the archive: never discarded, undone already, or past retention.
var ErrNothingToUndo = errors.New("nothing to undo: no discarded message of this run is in the archive (undone already, or past its retention)")

// Undo puts the messages discarded by run back into the store, with
// their ids, in one transaction that also records the audit entry
// (poison.undo, with the ids). A second Undo of the run finds nothing.
func (s *Store) Undo(ctx context.Context, runID, actor string) (UndoResult, error) {
	res := UndoResult{Run: runID}
	if actor == "" {
		return res, errors.New("pgpoison: an undo needs an actor for the audit log")
	}
	if runID == "" {
		return res, errors.New("pgpoison: an undo needs the run to undo")
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `WITH back AS (DELETE FROM `+ArchiveTable+` WHERE discard_run = $1 RETURNING `+archived+`)
			INSERT INTO `+Table+` (`+archived+`) SELECT `+archived+` FROM back ORDER BY id RETURNING id`, runID)
		if err != nil {
			return fmt.Errorf("putting discarded messages back: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return fmt.Errorf("putting discarded messages back: %w", err)
		}
		if len(ids) == 0 {
			return ErrNothingToUndo
		}
		slices.Sort(ids)
		res.Restored = ids
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: "poison.undo", Scope: "run " + runID, Count: len(ids),
			Detail: map[string]any{"ids": ids, "run": runID}})
	})
	return res, err
}

// Archived counts run's messages in the archive: what its Undo would put
// back.
func (s *Store) Archived(ctx context.Context, runID string) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+ArchiveTable+` WHERE discard_run = $1`, runID).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting archived messages: %w", err)
	}
	return n, nil
}

// CountArchivedBefore counts the archived messages discarded before
// cutoff (pgretention's dry run).
func CountArchivedBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time) (int64, error) {
	var n int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+ArchiveTable+` WHERE discarded_at < $1`, cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting the poison archive: %w", err)
	}
	return n, nil
}

// DeleteArchivedBefore removes at most n archived messages discarded
// before cutoff, in one transaction (pgretention's batch).
func DeleteArchivedBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time, n int) (int64, error) {
	tag, err := pool.Exec(ctx, `DELETE FROM `+ArchiveTable+` WHERE id IN (
		SELECT id FROM `+ArchiveTable+` WHERE discarded_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)`, cutoff, n)
	if err != nil {
		return 0, fmt.Errorf("pruning the poison archive: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Discard is DiscardEach collecting the discarded records.
func (s *Store) Discard(ctx context.Context, sel Selector, run Run) ([]Record, error) {
	var out []Record
	_, err := s.DiscardEach(ctx, sel, run, func(a Action) error {
		if a.Done {
			out = append(out, a.Record)
		}
		return nil
	})
	return out, err
}

var errDryRun = errors.New("dry run: roll back")

// audit records one page of an action, in its transaction: the ids acted
// on and those left, with why.
func audit(ctx context.Context, tx pgx.Tx, actor, action, scope, confirmation, runID string, actions []Action) error {
	if len(actions) == 0 && confirmation == "" {
		return nil
	}
	done, messages := []int64{}, []string{}
	left := map[string]string{}
	for _, a := range actions {
		if a.Done {
			done = append(done, a.Record.ID)
			messages = append(messages, a.Record.MessageID)
		} else {
			left[fmt.Sprint(a.Record.ID)] = pipeline.CleanText(a.Why, 300)
		}
	}
	detail := map[string]any{"ids": done, "message_ids": messages, "skipped": left, "run": runID}
	if confirmation != "" {
		detail["confirmation"] = confirmation
	}
	return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: action, Scope: scope, Count: len(done), Detail: detail})
}

// act runs do on every selected record, page by page, each record under
// a savepoint so that one that fails is skipped with its reason instead of
// aborting the page. Each page's audit entry is written in the page's
// transaction.
func (s *Store) act(ctx context.Context, sel Selector, run Run, action string, fn func(Action) error, do func(context.Context, pgx.Tx, Record) (string, error)) (Summary, error) {
	return s.actPages(ctx, sel, run, action, fn, func(ctx context.Context, tx pgx.Tx, recs []Record) ([]Action, error) {
		var actions []Action
		for _, r := range recs {
			a := Action{Record: r}
			sp, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			id, derr := do(ctx, sp, r)
			if derr != nil {
				if err := sp.Rollback(ctx); err != nil {
					return nil, err
				}
				a.Why = derr.Error()
			} else {
				if err := sp.Commit(ctx); err != nil {
					return nil, err
				}
				a.Done, a.MessageID = true, id
			}
			actions = append(actions, a)
		}
		return actions, nil
	})
}

// actPages is act with the page's records handed to doPage at once.
func (s *Store) actPages(ctx context.Context, sel Selector, run Run, action string, fn func(Action) error, doPage func(context.Context, pgx.Tx, []Record) ([]Action, error)) (Summary, error) {
	dryRun := run.DryRun
	run = run.named()
	sum := Summary{DryRun: dryRun, LastID: sel.AfterID, Run: run.ID}
	if err := sel.Validate(); err != nil {
		return sum, err
	}
	if !dryRun && run.Actor == "" {
		return sum, errors.New("pgpoison: a requeue or discard needs an actor for the audit log (Run.Actor)")
	}
	scope := run.Scope
	if scope == "" {
		scope = sel.Scope()
	}
	found := map[int64]bool{}
	first := true
	for {
		n := pageSize
		if sel.Limit > 0 {
			n = min(n, sel.Limit-sum.Done-sum.Skipped)
		}
		if n <= 0 {
			break
		}
		var actions []Action
		var last int64
		// A page's requeued messages wake the relays once it commits.
		pctx, committed := pipeline.WithAfterCommit(ctx)
		err := pgx.BeginFunc(pctx, s.pool, func(tx pgx.Tx) error {
			f := sel.Filter
			if sel.Topic != "" {
				f.Topic = sel.Topic
			}
			where, args := where(f, 5)
			maxID := sel.MaxID
			if maxID <= 0 {
				maxID = math.MaxInt64
			}
			rows, err := tx.Query(ctx, `SELECT `+columns+` FROM `+Table+`
				WHERE id > $1 AND id <= $4 AND (coalesce(cardinality($2::bigint[]), 0) = 0 OR id = ANY($2)) AND `+where+`
				ORDER BY id LIMIT $3 FOR UPDATE`, append([]any{sum.LastID, sel.IDs, n, maxID}, args...)...)
			if err != nil {
				return fmt.Errorf("selecting poisoned messages: %w", err)
			}
			recs, err := scanRecords(rows)
			if err != nil {
				return fmt.Errorf("reading poisoned messages: %w", err)
			}
			if len(recs) > 0 {
				last = recs[len(recs)-1].ID
			}
			actions, err = doPage(pctx, tx, recs)
			if err != nil {
				return err
			}
			if dryRun {
				for _, a := range actions {
					if err := fn(a); err != nil {
						return err
					}
				}
			}
			if dryRun {
				return errDryRun
			}
			confirmation := ""
			if first {
				confirmation = run.Confirmation
			}
			first = false
			return audit(ctx, tx, run.Actor, action, scope, confirmation, run.ID, actions)
		})
		if err != nil && !errors.Is(err, errDryRun) {
			return sum, err
		}
		if err == nil {
			committed()
		}
		for _, a := range actions {
			found[a.Record.ID] = true
			if a.Done {
				sum.Done++
			} else {
				sum.Skipped++
			}
			if !dryRun {
				if err := fn(a); err != nil {
					return sum, err
				}
			}
		}
		if len(actions) == 0 {
			break
		}
		sum.LastID = last
		if len(actions) < n {
			break
		}
	}
	for _, id := range sel.IDs {
		if !found[id] && !slices.Contains(sum.NotFound, id) {
			sum.NotFound = append(sum.NotFound, id)
		}
	}
	return sum, nil
}

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

// Bound is the newest message sel chooses now among the oldest limit (0:
// all), and how many that is: what a confirmation shows, and then binds
// the action to (Selector.MaxID, Selector.Limit), so that messages
// poisoned after it are not taken.
func (s *Store) Bound(ctx context.Context, sel Selector, limit int) (maxID int64, n int, err error) {
	f := sel.Filter
	if sel.Topic != "" {
		f.Topic = sel.Topic
	}
	cond, args := where(f, 3)
	lim := int64(math.MaxInt64)
	if limit > 0 {
		lim = int64(limit)
	}
	err = s.pool.QueryRow(ctx, `SELECT coalesce(max(id), 0), count(*) FROM (SELECT id FROM `+Table+`
		WHERE (coalesce(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1)) AND `+cond+` ORDER BY id LIMIT $2) c`,
		append([]any{sel.IDs, lim}, args...)...).Scan(&maxID, &n)
	if err != nil {
		return 0, 0, fmt.Errorf("bounding the selection: %w", err)
	}
	return maxID, n, nil
}
