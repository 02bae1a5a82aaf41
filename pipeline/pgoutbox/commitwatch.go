package pgoutbox

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Why a tracer: the README's way to publish, pgx.BeginFunc with Publish
// inside, commits where Ferry cannot see it, and pgx has no commit hook.
// Without one, only a probe of the outbox finds such a commit: 100 queries
// a second per idle relay, most of an idle process's cost. pgx's
// QueryTracer sees every statement of a pool's connections, COMMIT
// included, so a pool opened with a CommitWatch tells the relays itself,
// at the commit, whoever wrote the code that committed.

// insertMark starts every outbox insert the Outbox writes (InsertQuery):
// the CommitWatch knows them by it, at the cost of a prefix comparison per
// statement.
const insertMark = "/* ferry outbox */ "

// CommitWatch wakes the relays when a transaction that wrote outbox rows
// commits on a connection of a pool it watches (Watch), however it was
// committed: pgx.BeginFunc, tx.Commit, database/sql over the pool, or no
// transaction at all. Rows written by other code (a program in another
// language, a plain INSERT) are not seen: the relay's probe finds those.
// It is safe for concurrent use.
type CommitWatch struct {
	// open holds the connections whose open transaction wrote outbox rows.
	open     sync.Map // *pgx.Conn → struct{}
	onCommit atomic.Pointer[func()]
	// onCommitConn is told the connection too: a pool that serves many
	// tenants' schemas (tenancy) wakes the one that committed.
	onCommitConn atomic.Pointer[func(*pgx.Conn)]
}

type insertKey struct{}

// NewCommitWatch returns a CommitWatch that does nothing at a commit until
// OnCommit says what to do.
func NewCommitWatch() *CommitWatch { return &CommitWatch{} }

// OnCommit sets what runs after each commit of outbox rows (a Waker's
// Committed). It runs on the committing goroutine: keep it quick.
func (w *CommitWatch) OnCommit(fn func()) { w.onCommit.Store(&fn) }

// OnCommitConn sets a function told of each such commit with the
// connection it was made on, after OnCommit's.
func (w *CommitWatch) OnCommitConn(fn func(*pgx.Conn)) { w.onCommitConn.Store(&fn) }

// Watch makes the pool cfg configures report its commits to w: it sets
// the connections' tracer (cfg.ConnConfig.Tracer must be unset: pgx takes
// one) and forgets a connection when the pool closes it.
func (w *CommitWatch) Watch(cfg *pgxpool.Config) {
	cfg.ConnConfig.Tracer = w
	before := cfg.BeforeClose
	cfg.BeforeClose = func(c *pgx.Conn) {
		w.open.Delete(c)
		if before != nil {
			before(c)
		}
	}
}

// TraceQueryStart implements pgx.QueryTracer.
func (w *CommitWatch) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(data.SQL, insertMark) {
		return context.WithValue(ctx, insertKey{}, true)
	}
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer. A connection outside a
// transaction after a statement ('I': idle) ended the one it was in, if
// any: by COMMIT, by ROLLBACK (whose tag, or a failed transaction's COMMIT
// tag, is ROLLBACK), or because the insert ran on its own.
func (w *CommitWatch) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	if data.Err == nil && ctx.Value(insertKey{}) != nil {
		w.open.Store(conn, struct{}{})
	}
	if conn.PgConn().TxStatus() != 'I' {
		return
	}
	if _, wrote := w.open.LoadAndDelete(conn); !wrote || data.Err != nil || data.CommandTag.String() == "ROLLBACK" {
		return
	}
	if fn := w.onCommit.Load(); fn != nil {
		(*fn)()
	}
	if fn := w.onCommitConn.Load(); fn != nil {
		(*fn)(conn)
	}
}

var _ pgx.QueryTracer = (*CommitWatch)(nil)
