// Package pgretention prunes what Ferry keeps only for a while: dispatched
// outbox rows (default 30 days, optionally moved to outbox_archive) and the
// consumers' ledger (default 14 days), agent tool call records and the
// poison store's archive of discarded messages (default 14 days each).
// The weekly partitions of the outbox and the ledger go whole
// (pgoutbox.ClearPartitions, pgledger.ClearPartitions: a TRUNCATE leaves
// no dead tuple behind). The rest it deletes in small
// batches, each its own short transaction taking row locks with SKIP
// LOCKED, so pruning millions of rows never holds a long lock nor blocks
// the relay.
package pgretention

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgtoolcalls"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
)

// Defaults.
const (
	DefaultOutboxRetention = 30 * 24 * time.Hour
	DefaultLedgerRetention = 14 * 24 * time.Hour
	// DefaultToolCallRetention keeps agent tool call records as long as
	// the ledger: a host retrying a call after that runs it again.
	DefaultToolCallRetention = 14 * 24 * time.Hour
	// DefaultPoisonArchiveRetention is how long a discard can be undone.
	DefaultPoisonArchiveRetention = 14 * 24 * time.Hour
	DefaultBatchSize              = 10_000
	DefaultInterval               = time.Hour
)

// Target is what a prune removes.
type Target int

const (
	// Outbox is dispatched outbox rows (dispatched_at older than the retention).
	Outbox Target = iota
	// Ledger is processed_messages rows (processed_at older than the retention).
	Ledger
	// ToolCalls is agent tool call records (ferry_tool_calls, created_at
	// older than the retention).
	ToolCalls
	// PoisonArchive is discarded poison messages (ferry_poison_archive,
	// discarded_at older than the retention): past it, a discard cannot
	// be undone.
	PoisonArchive
)

func (t Target) String() string {
	switch t {
	case Ledger:
		return "ledger"
	case ToolCalls:
		return "tool-calls"
	case PoisonArchive:
		return "poison-archive"
	}
	return "outbox"
}

// Options of one prune.
type Options struct {
	// OlderThan is the retention: rows older than now-OlderThan go. Required.
	OlderThan time.Duration
	// BatchSize is how many rows one transaction removes. Default 10,000.
	BatchSize int
	// Archive moves outbox rows into the archive table (the outbox's name
	// with "_archive") instead of deleting them.
	Archive bool
	// Table is the outbox table. Default: the zero Table, "outbox".
	Table pgoutbox.Table
	// DryRun counts what would go and removes nothing.
	DryRun bool
}

// Result says what a prune did.
type Result struct {
	Target string    `json:"target"`
	Cutoff time.Time `json:"cutoff"`
	// Removed is how many rows went (with DryRun: would go).
	Removed int64 `json:"removed"`
	// Batches is how many transactions it took (with DryRun: would take).
	Batches int  `json:"batches"`
	DryRun  bool `json:"dry_run"`
	Archive bool `json:"archived"`
	// Partitions is what the weekly partitions of the outbox or the
	// ledger took (Removed counts their rows too): the partitions emptied
	// whole, the outbox's pending rows moved out of them first, those a
	// lock kept.
	Partitions *pgweeks.Cleared `json:"partitions,omitempty"`
}

// Prune removes t's rows older than the retention, batch by batch, until
// none is left or ctx ends (what was removed stays removed).
func Prune(ctx context.Context, pool *pgxpool.Pool, t Target, o Options) (Result, error) {
	if o.OlderThan <= 0 {
		return Result{}, errors.New("pgretention: the retention must be positive")
	}
	if o.BatchSize == 0 {
		o.BatchSize = DefaultBatchSize
	}
	if o.BatchSize < 1 {
		return Result{}, errors.New("pgretention: the batch size must be positive")
	}
	if o.Archive && t != Outbox {
		return Result{}, errors.New("pgretention: only the outbox can be archived")
	}
	res := Result{Target: t.String(), DryRun: o.DryRun, Archive: o.Archive}
	var cutoff time.Time
	if err := pool.QueryRow(ctx, `SELECT now() - $1 * interval '1 microsecond'`, o.OlderThan.Microseconds()).Scan(&cutoff); err != nil {
		return res, fmt.Errorf("computing cutoff: %w", err)
	}
	res.Cutoff = cutoff

	if t == Outbox || t == Ledger {
		// Whole partitions first; what is left to prune row by row is the
		// legacy partition's (or an unpartitioned table's).
		var parts []pgweeks.Partition
		var err error
		if t == Outbox {
			parts, _, err = o.Table.Partitions(ctx, pool)
		} else {
			parts, _, err = pgledger.Partitions(ctx, pool)
		}
		if err != nil {
			return res, err
		}
		if parts != nil {
			if o.OlderThan > pgweeks.MaxRetention {
				return res, fmt.Errorf("pgretention: a %s retention of %s is longer than its partitions serve (at most %s: %d weekly partitions)",
					t, o.OlderThan, pgweeks.MaxRetention, pgweeks.Slots)
			}
			var cleared pgweeks.Cleared
			if t == Outbox {
				cleared, err = o.Table.ClearPartitions(ctx, pool, cutoff, o.Archive, o.DryRun)
			} else {
				cleared, err = pgledger.ClearPartitions(ctx, pool, cutoff, o.DryRun)
			}
			res.Partitions = &cleared
			res.Removed += cleared.Rows
			if err != nil {
				return res, fmt.Errorf("pruning %s partitions: %w", t, err)
			}
		}
	}
	// Each table's owner holds its statements; this is the loop.
	var count func() (int64, error)
	var batch func() (int64, error)
	switch t {
	case Ledger:
		count = func() (int64, error) { return pgledger.CountBefore(ctx, pool, cutoff) }
		batch = func() (int64, error) { return pgledger.DeleteBefore(ctx, pool, cutoff, o.BatchSize) }
	case ToolCalls:
		count = func() (int64, error) { return pgtoolcalls.CountBefore(ctx, pool, cutoff) }
		batch = func() (int64, error) { return pgtoolcalls.DeleteBefore(ctx, pool, cutoff, o.BatchSize) }
	case PoisonArchive:
		count = func() (int64, error) { return pgpoison.CountArchivedBefore(ctx, pool, cutoff) }
		batch = func() (int64, error) { return pgpoison.DeleteArchivedBefore(ctx, pool, cutoff, o.BatchSize) }
	default:
		count = func() (int64, error) { return o.Table.CountDispatchedBefore(ctx, pool, cutoff) }
		batch = func() (int64, error) {
			return o.Table.DeleteDispatchedBefore(ctx, pool, cutoff, o.BatchSize, o.Archive)
		}
	}
	if o.DryRun {
		n, err := count()
		if err != nil {
			return res, fmt.Errorf("counting prunable %s rows: %w", t, err)
		}
		res.Removed += n
		// The batches a real run would take (it ends on a short batch, so
		// an exact multiple takes one more, empty, batch).
		res.Batches = int(n/int64(o.BatchSize)) + 1
		return res, nil
	}
	for {
		n, err := batch()
		if err != nil {
			return res, fmt.Errorf("pruning %s (after %d rows): %w", t, res.Removed, err)
		}
		res.Batches++
		res.Removed += n
		if n < int64(o.BatchSize) {
			return res, nil
		}
	}
}
