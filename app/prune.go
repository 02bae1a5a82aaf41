package app

import (
	"context"
	"errors"

	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
)

// Prune removes dispatched outbox rows, ledger rows, tool call records and
// discarded poison messages past their retention.
func (a *App) Prune(ctx context.Context) ([]pgretention.Result, error) {
	r := a.cfg.Retention
	out, err := pgretention.Prune(ctx, a.pool, pgretention.Outbox, pgretention.Options{OlderThan: r.Outbox, BatchSize: r.BatchSize, Archive: r.ArchiveOutbox, Table: a.cfg.Relay.Table})
	if err != nil {
		return nil, err
	}
	led, err := pgretention.Prune(ctx, a.pool, pgretention.Ledger, pgretention.Options{OlderThan: r.Ledger, BatchSize: r.BatchSize})
	if err != nil {
		return []pgretention.Result{out}, err
	}
	calls, err := pgretention.Prune(ctx, a.pool, pgretention.ToolCalls, pgretention.Options{OlderThan: r.ToolCalls, BatchSize: r.BatchSize})
	if err != nil {
		return []pgretention.Result{out, led}, err
	}
	archive, err := pgretention.Prune(ctx, a.pool, pgretention.PoisonArchive, pgretention.Options{OlderThan: r.PoisonArchive, BatchSize: r.BatchSize})
	if err != nil {
		return []pgretention.Result{out, led, calls}, err
	}
	return []pgretention.Result{out, led, calls, archive}, nil
}

// pruner prunes at start and every interval; a failed prune is logged
// and tried again next time.
func (a *App) pruner() periodic.Service {
	return periodic.Service{Name: "pruner", Interval: a.cfg.Retention.Interval, Immediate: true, ErrorMessage: "pruning failed",
		Tick: func(ctx context.Context) error {
			res, err := a.Prune(ctx)
			for _, r := range res {
				if r.Removed > 0 {
					a.logger.Info("pruned", "target", r.Target, "removed", r.Removed, "cutoff", r.Cutoff, "archived", r.Archive)
				}
			}
			// Holds whose consumer never came back, with their copies of
			// the head's payload and headers.
			stale, serr := pgheld.PruneStale(ctx, a.pool)
			if stale > 0 {
				a.logger.Info("pruned", "target", "stale held partitions", "removed", stale)
			}
			return errors.Join(err, serr)
		}}
}
