package pipeline

import (
	"context"
	"sync"
)

// A transaction's code does not know when it commits: the code that begins
// and commits it does. AfterCommit lets the first ask the second to run
// something once the commit has happened (the outbox uses it to wake the
// relays, which must not happen before the rows are visible, nor inside
// the transaction, where a NOTIFY would serialize every commit of the
// database). pgx has no commit hook, hence this context-borne list.

type afterCommitKey struct{}

type afterCommit struct {
	mu   sync.Mutex
	keys map[any]bool
	fns  []func()
}

// WithAfterCommit returns a context that collects AfterCommit callbacks
// and the function that runs them: call it once the transaction committed
// (never after a rollback). Ferry's ledger does this for the handler's
// transaction; code that begins its own transaction and publishes with
// pgoutbox's PublishTx does it to wake the relays at once:
//
//	ctx, committed := pipeline.WithAfterCommit(ctx)
//	tx, _ := pool.Begin(ctx)
//	... outbox.PublishTx(ctx, pgoutbox.PgxTx(tx), ...) ...
//	if err := tx.Commit(ctx); err == nil {
//		committed()
//	}
func WithAfterCommit(ctx context.Context) (context.Context, func()) {
	ac := &afterCommit{}
	return context.WithValue(ctx, afterCommitKey{}, ac), func() {
		ac.mu.Lock()
		fns := ac.fns
		ac.fns, ac.keys = nil, nil
		ac.mu.Unlock()
		for _, fn := range fns {
			fn()
		}
	}
}

// AfterCommit registers fn to run after the transaction of ctx commits,
// once per key however often it is registered (a handler publishing a
// thousand events wakes the relays once), and reports whether ctx carries
// such a list (WithAfterCommit).
func AfterCommit(ctx context.Context, key any, fn func()) bool {
	ac, ok := ctx.Value(afterCommitKey{}).(*afterCommit)
	if !ok {
		return false
	}
	ac.mu.Lock()
	defer ac.mu.Unlock()
	if ac.keys[key] {
		return true
	}
	if ac.keys == nil {
		ac.keys = map[any]bool{}
	}
	ac.keys[key] = true
	ac.fns = append(ac.fns, fn)
	return true
}
