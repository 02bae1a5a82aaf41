package pgoutbox

import (
	"context"
	"time"
)

// Compatibility with relays and rows from before the append-only lane
// (migration 00024): a relay of an earlier version marks each row it
// sends (MarkEachRow, here), and rows written before the migration have
// no tx (the slow lane takes them, slowCond). Both paths can go in the
// first release that refuses to run beside a relay from before 00024 and
// whose migrations give every row a tx (the legacy partition emptied by
// retention); docs/operations.md, "Upgrading to migration 00024 on a live
// system", says how a rolling upgrade uses them until then.

// markCheckInterval is how often RelayConfig.MarkEachRow is asked.
const markCheckInterval = 5 * time.Second

// markEachUnknown is the log line of a failed checkMarkEachRow.
const markEachUnknown = "relay could not tell whether relays of an earlier version run; it keeps marking each row it sends"

// checkMarkEachRow asks RelayConfig.MarkEachRow; a failed answer keeps
// the last one.
func (r *Relay) checkMarkEachRow(ctx context.Context) error {
	mark, err := r.cfg.MarkEachRow(ctx)
	if err != nil {
		return err
	}
	if r.markEach.Swap(mark) != mark {
		if mark {
			r.logger.Warn("a relay of an earlier version is running: this relay marks each row it sends, until it stops")
		} else {
			r.logger.Info("no relay of an earlier version runs: rows are passed, not marked")
		}
	}
	return nil
}
