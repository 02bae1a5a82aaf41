package pgpoison

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/internal/republish"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The operator's actions on the poison store: requeue, discard (into the
// archive) and undo, each in pages, audited in its own transaction.

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
// their ids (UndoEach, collecting the ids).
func (s *Store) Undo(ctx context.Context, runID, actor string) (UndoResult, error) {
	res := UndoResult{Run: runID}
	_, err := s.UndoEach(ctx, runID, actor, func(ids []int64) error {
		res.Restored = append(res.Restored, ids...)
		return nil
	})
	return res, err
}

// UndoEach puts the messages discarded by run back into the store, with
// their ids, a page (pageSize) per transaction, each with its audit entry
// (poison.undo: how many and the run, not the ids, which the discard's
// entries list already: a whole run's ids made one entry of ~1.4 MB at
// 250,000), oldest first, and tells fn each page's ids as it commits. A
// run cut short leaves put back exactly what its committed pages say; an
// undo of the same run again puts back the rest. ErrNothingToUndo when the
// archive holds none of run's messages.
func (s *Store) UndoEach(ctx context.Context, runID, actor string, fn func([]int64) error) (int, error) {
	if actor == "" {
		return 0, errors.New("pgpoison: an undo needs an actor for the audit log")
	}
	if runID == "" {
		return 0, errors.New("pgpoison: an undo needs the run to undo")
	}
	total := 0
	for {
		var ids []int64
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `WITH page AS (SELECT id FROM `+ArchiveTable+` WHERE discard_run = $1 ORDER BY id LIMIT $2 FOR UPDATE),
				back AS (DELETE FROM `+ArchiveTable+` a USING page WHERE a.id = page.id AND a.discard_run = $1 RETURNING `+prefixed("a", archived)+`)
				INSERT INTO `+Table+` (`+archived+`) SELECT `+archived+` FROM back ORDER BY id RETURNING id`, runID, pageSize)
			if err != nil {
				return fmt.Errorf("putting discarded messages back: %w", err)
			}
			if ids, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
				return fmt.Errorf("putting discarded messages back: %w", err)
			}
			if len(ids) == 0 {
				return nil
			}
			slices.Sort(ids)
			return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: "poison.undo", Scope: "run " + runID, Count: len(ids),
				Detail: map[string]any{"run": runID, "first_id": ids[0], "last_id": ids[len(ids)-1]}})
		})
		if err != nil {
			return total, err
		}
		if len(ids) == 0 {
			if total == 0 {
				return 0, ErrNothingToUndo
			}
			return total, nil
		}
		total += len(ids)
		if err := fn(ids); err != nil {
			return total, err
		}
	}
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
	// Chosen by id (a confirmation's ids, up to 250,000): each page takes
	// the next pageSize of them, sorted, so that no page's query carries
	// the whole list.
	byID := slices.Compact(slices.Sorted(slices.Values(sel.IDs)))
	for {
		n := pageSize
		if sel.Limit > 0 {
			n = min(n, sel.Limit-sum.Done-sum.Skipped)
		}
		if n <= 0 {
			break
		}
		var chunk []int64
		if len(sel.IDs) > 0 {
			from, _ := slices.BinarySearch(byID, sum.LastID+1)
			if from == len(byID) {
				break
			}
			chunk = byID[from:min(from+n, len(byID))]
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
			where, args := where(f, 4)
			rows, err := tx.Query(ctx, `SELECT `+columns+` FROM `+Table+`
				WHERE id > $1 AND (coalesce(cardinality($2::bigint[]), 0) = 0 OR id = ANY($2)) AND `+where+`
				ORDER BY id LIMIT $3 FOR UPDATE`, append([]any{sum.LastID, chunk, n}, args...)...)
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
		if chunk != nil {
			// The next page starts after this chunk, whether or not its
			// messages were still there.
			sum.LastID = chunk[len(chunk)-1]
			continue
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

// SelectIDs returns the ids of the messages sel chooses now, oldest
// first, at most limit (0: all), and how many it chooses in all: what a
// preview shows and a confirmation then binds the action to (pgconfirm:
// the action takes these ids and nothing else).
func (s *Store) SelectIDs(ctx context.Context, sel Selector, limit int) (ids []int64, total int, err error) {
	if err := sel.Validate(); err != nil {
		return nil, 0, err
	}
	f := sel.Filter
	if sel.Topic != "" {
		f.Topic = sel.Topic
	}
	cond, args := where(f, 3)
	lim := int64(math.MaxInt64)
	if limit > 0 {
		lim = int64(limit)
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// One snapshot for the count and the ids.
		if _, err := tx.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY`); err != nil {
			return err
		}
		countCond, countArgs := where(f, 2)
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+Table+` WHERE (coalesce(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1)) AND `+countCond,
			append([]any{sel.IDs}, countArgs...)...).Scan(&total); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `SELECT id FROM `+Table+` WHERE (coalesce(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1)) AND `+cond+` ORDER BY id LIMIT $2`,
			append([]any{sel.IDs, lim}, args...)...)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("selecting the messages to confirm: %w", err)
	}
	return ids, total, nil
}

// prefixed is the column list cols with each column qualified by alias.
func prefixed(alias, cols string) string {
	parts := strings.Split(cols, ",")
	for i, p := range parts {
		parts[i] = alias + "." + strings.TrimSpace(p)
	}
	return strings.Join(parts, ", ")
}
