package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The id lane: the CDC relay learns from the WAL which rows committed and
// hands their ids to RelayIDs, which needs no claim scan.

// ErrNothingConfirmed is RelayIDs' answer when it published and the broker
// confirmed none of it: most likely the broker is unreachable. Nothing was
// recorded (the rows are as they were), so the caller can hold its
// position and try the same rows again.
var ErrNothingConfirmed = errors.New("pgoutbox: the broker confirmed none of the batch")

// ErrBrokerUnreachable is a batch's answer when the relay's own connection
// to the broker is down (its publisher's errors are marked
// pipeline.Infrastructure) and nothing was confirmed: nothing was recorded,
// no row spent an attempt, and the relay waits before its next batch while
// other relays take the rows. It is an ErrNothingConfirmed.
var ErrBrokerUnreachable = fmt.Errorf("%w: the relay cannot reach the broker", ErrNothingConfirmed)

// RelayIDs relays the outbox rows with these ids, by the rules of
// RelayBatch: it is the CDC relay's way in, which learns from the WAL which
// rows committed and so needs no claim scan. In one transaction it locks
// the rows by primary key (FOR UPDATE SKIP LOCKED, so a polling relay and
// it never hold one row at once), publishes those it may and records the
// outcome. It leaves pending, for the polling relay, each row that is
// delayed (available_at in the future), held by another relay, or of an
// ordered topic and behind an earlier pending row of its aggregate; a
// later row of that aggregate in ids is left too, so order per aggregate
// holds. A row already dispatched (ids replayed after a crash) is skipped,
// not sent again. A row whose publish fails is recorded as RelayBatch
// records it (attempts, last_error, available_at by Backoff) and retried by
// the polling relay, unless the broker confirmed none of the batch: then
// nothing is recorded and the error is ErrNothingConfirmed.
func (r *Relay) RelayIDs(ctx context.Context, ids []int64) (res BatchResult, err error) {
	if len(ids) == 0 {
		return res, nil
	}
	tx, err := r.pool.BeginTx(ctx, r.txOptions)
	if err != nil {
		return res, fmt.Errorf("beginning relay transaction: %w", err)
	}
	defer func() {
		if err != nil {
			rollback(ctx, tx)
		}
	}()
	found, err := r.lockByID(ctx, tx, ids)
	if err != nil {
		return res, err
	}
	res.Missing = missingIDs(found, ids)
	claimed := r.sortLocked(found, &res)
	res.Claimed = len(claimed)
	r.claims.Add(1)
	if len(claimed) == 0 {
		return res, tx.Commit(ctx)
	}
	res, err = r.relayClaimed(ctx, tx, claimed, res, true, nil)
	if errors.Is(err, ErrNothingConfirmed) {
		return BatchResult{}, err
	}
	return res, err
}

// lockedRow is a row RelayIDs asked for: locked false when another relay
// holds it (its columns other than topic and aggregate are then unknown).
type lockedRow struct {
	claimedRow
	locked, done, due, behind bool
}

// lockByID locks the rows of ids it can (lockSQL) and reads every one.
func (r *Relay) lockByID(ctx context.Context, tx pgx.Tx, ids []int64) ([]lockedRow, error) {
	rows, err := tx.Query(ctx, r.lockSQL, pgx.NamedArgs{"ids": ids, "topics": r.ordered})
	if err != nil {
		return nil, fmt.Errorf("locking outbox rows by id: %w", err)
	}
	found, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (lockedRow, error) {
		var c lockedRow
		// The row's columns are NULL where another relay holds the row.
		var attempts *int32
		var createdAt, dueAt *time.Time
		var shadow, done, due, behind *bool
		if err := row.Scan(&c.id, &c.topic, &c.aggregateID, &c.locked, &c.uuid, &c.payload, &c.headers, &attempts, &createdAt, &dueAt, &shadow, &done, &due, &behind); err != nil {
			return c, err
		}
		if c.locked {
			c.attempts, c.createdAt, c.dueAt = int(*attempts), *createdAt, *dueAt
			c.shadowMarked, c.done, c.due, c.behind = *shadow, *done, *due, *behind
		}
		return c, nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading locked outbox rows: %w", err)
	}
	return found, nil
}

// missingIDs are the ids lockByID did not find.
func missingIDs(found []lockedRow, ids []int64) []int64 {
	if len(found) == len(ids) {
		return nil
	}
	seen := make(map[int64]bool, len(found))
	for _, c := range found {
		seen[c.id] = true
	}
	var missing []int64
	for _, id := range ids {
		if !seen[id] {
			missing = append(missing, id)
		}
	}
	return missing
}

// sortLocked keeps the rows to publish, counting in res those left and
// skipped. A row of an ordered aggregate that is left blocks the
// aggregate's later rows in this call.
func (r *Relay) sortLocked(found []lockedRow, res *BatchResult) []claimedRow {
	blocked := map[string]bool{}
	var claimed []claimedRow
	for _, c := range found {
		key, ordered := r.orderKey(c.claimedRow)
		switch {
		case ordered && blocked[key]:
			res.Left++
		case c.locked && c.done:
			res.Skipped++
		case !c.locked || !c.due || c.behind:
			res.Left++
			if ordered {
				blocked[key] = true
			}
		default:
			claimed = append(claimed, c.claimedRow)
		}
	}
	return claimed
}
