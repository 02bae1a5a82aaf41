package pgoutbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// The slow lane: rows with state of their own (a failed publish, a delay,
// a row held behind an earlier pending row of its ordered aggregate),
// claimed FOR UPDATE SKIP LOCKED by the partial indexes on them and
// marked dispatched one by one (see lanes.go).

// slowBatch claims one batch of the slow lane's due rows, publishes them
// and records the outcome, in one transaction.
func (r *Relay) slowBatch(ctx context.Context) (res BatchResult, err error) {
	tx, err := r.pool.BeginTx(ctx, r.txOptions)
	if err != nil {
		return res, fmt.Errorf("beginning claim transaction: %w", err)
	}
	defer func() {
		if err != nil {
			rollback(ctx, tx)
		}
	}()

	args := pgx.NamedArgs{"limit": r.cfg.BatchSize, "topics": r.ordered}
	claimed, err := collectClaimed(ctx, tx, r.claimSQL, args)
	if err != nil {
		return res, err
	}
	n := len(claimed)
	// The aggregates of the rows with a previous row, read before
	// runsFromHeads reuses the slice.
	var aggregates []string
	for _, c := range claimed {
		if c.prev != nil && !slices.Contains(aggregates, c.aggregateID) {
			aggregates = append(aggregates, c.aggregateID)
		}
	}
	if claimed = runsFromHeads(claimed); len(claimed) < n {
		// Rows behind heads the page did not reach: take their aggregates'
		// runs from the heads (headsSQL). Rows this batch holds already
		// come again; the others wait for the next claim.
		args["aggregates"] = aggregates
		runs, err := collectClaimed(ctx, tx, r.headsSQL, args)
		if err != nil {
			return res, err
		}
		claimed = append(claimed, runs...)
		slices.SortFunc(claimed, func(a, b claimedRow) int { return cmp.Compare(a.id, b.id) })
		claimed = runsFromHeads(slices.CompactFunc(claimed, func(a, b claimedRow) bool { return a.id == b.id }))
	}
	// Each aggregate's rows are a run from its head, in id order: cutting
	// the list in id order keeps a run of each.
	claimed = claimed[:min(len(claimed), r.cfg.BatchSize)]
	res.Claimed = len(claimed)
	r.claims.Add(1)
	if len(claimed) == 0 {
		return res, tx.Commit(ctx)
	}
	for _, c := range claimed {
		if _, ok := r.orderKey(c); ok {
			res.Ordered++
		}
	}
	return r.relayClaimed(ctx, tx, claimed, res, false, nil)
}

// collectClaimed runs a slow lane claim (claimSQL, headsSQL).
func collectClaimed(ctx context.Context, tx pgx.Tx, sql string, args ...any) ([]claimedRow, error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("claiming outbox rows: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (claimedRow, error) {
		var c claimedRow
		err := row.Scan(&c.id, &c.uuid, &c.aggregateID, &c.topic, &c.payload, &c.headers, &c.attempts, &c.createdAt, &c.dueAt, &c.shadowMarked, &c.prev)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading claimed outbox rows: %w", err)
	}
	return claimed, nil
}

// runsFromHeads keeps, of the claimed rows, those of unordered topics and,
// per ordered aggregate, its run from its head: a row whose previous
// pending row this batch did not take (another relay holds it, or LIMIT
// left it out) stays, locked until the batch ends, for a later batch, and
// so does every row after it.
func runsFromHeads(claimed []claimedRow) []claimedRow {
	slices.SortFunc(claimed, func(a, b claimedRow) int { return cmp.Compare(a.id, b.id) })
	kept := make(map[int64]bool, len(claimed))
	out := claimed[:0]
	for _, c := range claimed {
		if c.prev != nil && !kept[*c.prev] {
			continue
		}
		kept[c.id] = true
		out = append(out, c)
	}
	return out
}

type claimedRow struct {
	id          int64
	uuid        *string
	aggregateID string
	topic       string
	payload     []byte
	headers     map[string]any
	attempts    int
	createdAt   time.Time
	// dueAt is when the row first became due (due_at; its creation on rows
	// written before the column).
	dueAt time.Time
	// shadowMarked: shadow_mode "true" in the headers (Ferry's metadata,
	// never the payload).
	shadowMarked bool
	// prev is the slow lane's claim's: the id of the previous pending row
	// of the row's ordered aggregate, nil at its head (claimSQL).
	prev *int64
}
