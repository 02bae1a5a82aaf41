// Package pgledger is the consumers' durable idempotency ledger in
// PostgreSQL (the processed_messages table).
//
// Once runs a handler inside a transaction that first inserts the
// (consumer, message id) row. The primary key makes a second, concurrent
// delivery of the same message wait for the first: if the first commits,
// the second sees the row and skips the effect; if it rolls back, the
// second runs it. The handler's own database writes join the same
// transaction (TxFromContext), so "effect recorded" and "message recorded"
// cannot disagree.
//
// An external call made by the handler (a card charge) cannot join the
// transaction; it is made inside it, with the message id as its
// idempotency key, so the rare redelivery after a lost commit is
// deduplicated by the provider.
package pgledger

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
)

// DefaultTable is the ledger table created by Ferry's migrations.
const DefaultTable = "processed_messages"

// DefaultTakeOverAfter is Config.TakeOverAfter's default.
const DefaultTakeOverAfter = 5 * time.Second

// Config configures a Ledger.
type Config struct {
	// Table is the ledger table's name. Default "processed_messages".
	Table string
	// TakeOverAfter bounds how long a delivery waits on another
	// transaction holding its message's ledger row when that transaction
	// has sent the server nothing for this long (idle in transaction): its
	// process lost its link to the database (a black hole, a paused VM)
	// after the server took its insert, and its delivery came here. The
	// server would keep that transaction until the connection ends (TCP
	// keepalives, often hours); past this, the waiting delivery ends that
	// session and runs the handler, whose effects the message id keys. A
	// holder that is busy (a statement running) is never ended. Default
	// 5 s; negative: never.
	TakeOverAfter time.Duration
}

// Ledger records which messages each consumer has processed.
// It is safe for concurrent use.
type Ledger struct {
	pool          *pgxpool.Pool
	logger        *slog.Logger
	takeOverAfter time.Duration
	insertSQL     string
	existsSQL     string
	digestSQL     string
	batchSQL      string
	digestsSQL    string
	missingSQL    string
}

// New returns a Ledger over pool.
func New(pool *pgxpool.Pool, cfg Config, logger *slog.Logger) (*Ledger, error) {
	if pool == nil {
		return nil, errors.New("pgledger: New needs a pool")
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.TakeOverAfter == 0 {
		cfg.TakeOverAfter = DefaultTakeOverAfter
	}
	t := pgx.Identifier{cfg.Table}.Sanitize()
	return &Ledger{
		pool:          pool,
		logger:        logger,
		takeOverAfter: cfg.TakeOverAfter,
		insertSQL:     `INSERT INTO ` + t + ` (consumer, message_id, payload_sha256) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`,
		existsSQL:     `SELECT processed_at FROM ` + t + ` WHERE consumer = $1 AND message_id = $2`,
		digestSQL:     `SELECT payload_sha256 FROM ` + t + ` WHERE consumer = $1 AND message_id = $2`,
		batchSQL: `INSERT INTO ` + t + ` (consumer, message_id, payload_sha256)
			SELECT $1, m.id, m.digest FROM unnest($2::text[], $3::bytea[]) AS m(id, digest)
			ON CONFLICT DO NOTHING RETURNING message_id`,
		digestsSQL: `SELECT message_id, payload_sha256 FROM ` + t + ` WHERE consumer = $1 AND message_id = ANY($2::text[])`,
		missingSQL: `SELECT m.id FROM unnest($2::text[]) WITH ORDINALITY AS m(id, n)
			WHERE NOT EXISTS (SELECT 1 FROM ` + t + ` p WHERE p.consumer = $1 AND p.message_id = m.id) ORDER BY m.n`,
	}, nil
}

type txKey struct{}

// TxFromContext returns the ledger transaction a handler runs in, for the
// handler's own writes, or nil outside Once.
func TxFromContext(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey{}).(pgx.Tx)
	return tx
}

// Once runs fn unless consumer has already processed messageID. ran reports
// whether fn was called. fn's error rolls back the ledger row with fn's own
// writes, so a later delivery tries again; a commit error is returned too,
// since the effect is then not recorded.
//
// digest (pipeline.ContentDigest of the message: its payload and content
// metadata; nil to skip the check) is stored with the row: a later delivery
// of messageID whose digest is not the same content (pipeline.SameContent)
// is not a redelivery, and Once returns an error wrapping
// pipeline.ErrIDConflict instead of skipping it silently.
//
// Failures of the ledger's own statements (BEGIN, its row, the digest read:
// with the ids checked first, only the database can fail them: unreachable,
// refusing connections, a table migrated away), a commit the database
// could not make, and fn's errors when they come from the ledger
// transaction's connection breaking, are marked pipeline.Infrastructure:
// the message is not at fault, and waits.
func (l *Ledger) Once(ctx context.Context, consumer, messageID string, digest []byte, fn func(ctx context.Context) error) (ran bool, err error) {
	if err := checkKey(consumer, messageID); err != nil {
		return false, err
	}
	tx, br, err := l.begin(ctx, l.insertSQL, consumer, messageID, digest)
	defer tx.end(ctx)
	if err != nil {
		return false, err
	}
	tag, err := br.Exec()
	tx.unwatch()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, pipeline.Infrastructure(fmt.Errorf("recording message %s for %s in ledger: %w", messageID, consumer, err))
	}
	if tag.RowsAffected() == 0 {
		// Processed before (or by a concurrent delivery that committed):
		// the same message, unless its content differs.
		var stored []byte
		if err := tx.tx.QueryRow(ctx, l.digestSQL, consumer, messageID).Scan(&stored); err != nil {
			return false, pipeline.Infrastructure(fmt.Errorf("reading ledger entry of message %s for %s: %w", messageID, consumer, err))
		}
		if !pipeline.SameContent(stored, digest) {
			return false, conflictError(consumer, messageID, stored, digest)
		}
		return false, nil
	}
	hctx, afterCommit := tx.handlerContext(ctx)
	if err := fn(hctx); err != nil {
		return true, handlerError(tx, err)
	}
	if err := tx.commit(ctx, afterCommit); err != nil {
		return true, pgdb.MarkUnavailable(fmt.Errorf("committing ledger entry for message %s (%s): %w", messageID, consumer, err))
	}
	return true, nil
}

// checkKey refuses a ledger key the table cannot store.
func checkKey(consumer, messageID string) error {
	if consumer == "" || messageID == "" {
		return errors.New("pgledger: consumer and message id must not be empty")
	}
	if !pipeline.ValidText(consumer) || !pipeline.ValidText(messageID) {
		return fmt.Errorf("pgledger: message id %q (consumer %q) must be valid UTF-8 without NUL", pipeline.CleanText(messageID, 200), pipeline.CleanText(consumer, 200))
	}
	return nil
}

// conflictError reports a processed message id delivered again with other
// content.
func conflictError(consumer, messageID string, stored, digest []byte) error {
	return fmt.Errorf("%w: %s processed message %s with content digest %x, this delivery has %x",
		pipeline.ErrIDConflict, consumer, messageID, stored, digest)
}

// ledgerTx is a ledger transaction whose first statement went with its
// BEGIN (begin).
type ledgerTx struct {
	tx        pgx.Tx
	committed bool
	// unwatch stops the watch on the first statement's wait (takeOver).
	unwatch func()
}

// begin sends BEGIN and the ledger's first statement in one round trip
// (pgx's Batch.BeginTx); the pool keeps the connection until the
// transaction ends. The caller defers end whatever the error, then reads
// the statement's result from br and closes it.
func (l *Ledger) begin(ctx context.Context, sql string, args ...any) (ledgerTx, pgx.BatchResults, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(sql, args...)
	br := l.pool.SendBatch(ctx, b)
	t := ledgerTx{tx: br.Tx(), unwatch: func() {}}
	if conn := t.tx.Conn(); conn != nil && !conn.IsClosed() && l.takeOverAfter > 0 {
		t.unwatch = l.watch(ctx, conn.PgConn().PID())
	}
	if _, err := br.Exec(); err != nil {
		t.unwatch()
		_ = br.Close()
		return t, nil, pipeline.Infrastructure(fmt.Errorf("beginning ledger transaction: %w", err))
	}
	return t, br, nil
}

// end rolls the transaction back unless it committed: also when a
// handler's panic unwinds through the caller, so that the rows it claimed
// do not outlive it.
func (t *ledgerTx) end(ctx context.Context) {
	t.unwatch()
	if t.committed {
		return
	}
	rbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = t.tx.Rollback(rbCtx)
}

// handlerContext is ctx carrying the transaction for the handler's writes
// (TxFromContext); the handler's events wake the relays once it commits
// (pgoutbox), through afterCommit.
func (t *ledgerTx) handlerContext(ctx context.Context) (hctx context.Context, afterCommit func()) {
	return pipeline.WithAfterCommit(context.WithValue(ctx, txKey{}, t.tx))
}

// commit commits and then runs afterCommit.
func (t *ledgerTx) commit(ctx context.Context, afterCommit func()) error {
	if err := t.tx.Commit(ctx); err != nil {
		return err
	}
	t.committed = true
	afterCommit()
	return nil
}

// handlerError is a handler's error as the ledger reports it: marked
// pipeline.Infrastructure when the ledger transaction's connection broke
// under the handler, or its writes lost a serialization race or a
// deadlock: the database failed, not the message. An external call's
// failure stays the handler's.
func handlerError(t ledgerTx, err error) error {
	var pgErr *pgconn.PgError
	if t.tx.Conn().IsClosed() || (errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")) {
		return pipeline.Infrastructure(err)
	}
	return err
}

// Processed reports whether consumer has processed messageID.
func (l *Ledger) Processed(ctx context.Context, consumer, messageID string) (bool, error) {
	var at time.Time
	err := l.pool.QueryRow(ctx, l.existsSQL, consumer, messageID).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("looking up message %s for %s: %w", messageID, consumer, err)
	}
	return true, nil
}

// Unprocessed returns the ids of messageIDs that consumer has not
// processed, in their order: one statement for a set (a test waiting for
// its events to be handled, a tool comparing what was sent).
func (l *Ledger) Unprocessed(ctx context.Context, consumer string, messageIDs []string) ([]string, error) {
	rows, err := l.pool.Query(ctx, l.missingSQL, consumer, messageIDs)
	if err != nil {
		return nil, fmt.Errorf("looking up %d message(s) for %s: %w", len(messageIDs), consumer, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// OnceBatch is Once for many messages of one consumer: one transaction
// inserts all their rows with one statement, fn runs once with the indexes
// (in entries' order) of those not processed before, and one commit
// records them with fn's writes. Entries processed before are reported as
// duplicates, or conflicts when their content differs; fn does not see
// them. If fn is called with no fresh entries it is not called at all.
//
// An error means nothing of the batch was recorded (rolled back), except
// after a failed COMMIT, whose outcome the client cannot know: callers
// retry the entries one by one with Once, which tells the two apart. Errors
// are marked as Once's are. The message ids must be distinct.
func (l *Ledger) OnceBatch(ctx context.Context, consumer string, entries []pipeline.LedgerEntry, fn func(ctx context.Context, fresh []int) error) ([]pipeline.LedgerResult, error) {
	ids := make([]string, len(entries))
	digests := make([][]byte, len(entries))
	index := make(map[string]int, len(entries))
	for i, e := range entries {
		if err := checkKey(consumer, e.MessageID); err != nil {
			return nil, err
		}
		if _, dup := index[e.MessageID]; dup {
			return nil, fmt.Errorf("pgledger: message id %q appears twice in one batch", pipeline.CleanText(e.MessageID, 200))
		}
		index[e.MessageID] = i
		ids[i], digests[i] = e.MessageID, e.Digest
	}
	results := make([]pipeline.LedgerResult, len(entries))
	if len(entries) == 0 {
		return results, nil
	}
	tx, br, err := l.begin(ctx, l.batchSQL, consumer, ids, digests)
	defer tx.end(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := br.Query()
	var inserted []string
	if err == nil {
		inserted, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	tx.unwatch()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, pipeline.Infrastructure(fmt.Errorf("recording %d messages for %s in ledger: %w", len(entries), consumer, err))
	}
	for _, id := range inserted {
		results[index[id]].Ran = true
	}
	if len(inserted) < len(entries) {
		// Processed before (or by a concurrent delivery that committed):
		// the same messages, unless their content differs.
		var seen []string
		for i, r := range results {
			if !r.Ran {
				seen = append(seen, ids[i])
			}
		}
		rows, err := tx.tx.Query(ctx, l.digestsSQL, consumer, seen)
		if err != nil {
			return nil, pipeline.Infrastructure(fmt.Errorf("reading ledger entries for %s: %w", consumer, err))
		}
		var id string
		var stored []byte
		_, err = pgx.ForEachRow(rows, []any{&id, &stored}, func() error {
			i := index[id]
			if !pipeline.SameContent(stored, digests[i]) {
				results[i].Err = conflictError(consumer, id, stored, digests[i])
			}
			return nil
		})
		if err != nil {
			return nil, pipeline.Infrastructure(fmt.Errorf("reading ledger entries for %s: %w", consumer, err))
		}
	}
	fresh := make([]int, 0, len(inserted))
	for i, r := range results {
		if r.Ran {
			fresh = append(fresh, i)
		}
	}
	hctx, afterCommit := tx.handlerContext(ctx)
	if len(fresh) > 0 {
		if err := fn(hctx, fresh); err != nil {
			return nil, handlerError(tx, err)
		}
	}
	if err := tx.commit(ctx, afterCommit); err != nil {
		return nil, pgdb.MarkUnavailable(fmt.Errorf("committing ledger entries of %d messages (%s): %w", len(entries), consumer, err))
	}
	return results, nil
}

// Partitions lists the ledger's weekly partitions (migration 00026; see
// pgweeks), or nil when it is not partitioned. now is the database's
// clock.
func Partitions(ctx context.Context, q pgweeks.Reader) ([]pgweeks.Partition, time.Time, error) {
	// The legacy partition keeps the processed_at index it had as a table.
	return pgweeks.List(ctx, q, DefaultTable, func(qp string) string {
		return `SELECT max(processed_at) FROM ` + qp
	})
}

// ClearPartitions empties, with TRUNCATE, each partition of the ledger
// (DefaultTable) whose rows were all processed before cutoff. Nothing in
// it is still needed: a ledger row only says a message ran, and past
// retention a redelivery may run again by definition. A partition a lock
// keeps (a consumer's long transaction: every ledger insert reads all the
// partitions for the message's key) is reported waiting, not waited for. A
// table that is not partitioned is left alone.
//
// Then it records in RingTable the weeks that still hold rows, so that a
// consumer's insert looks for its message's key in those partitions only
// (the trigger of migration 00026).
func ClearPartitions(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time, dryRun bool) (res pgweeks.Cleared, err error) {
	parts, _, err := Partitions(ctx, pool)
	if err != nil {
		return res, err
	}
	if !dryRun && parts != nil {
		defer func() {
			if err == nil {
				err = narrowRing(ctx, pool)
			}
		}()
	}
	for _, p := range parts {
		if !p.PastRetention(cutoff) {
			continue
		}
		qp := pgweeks.Name(DefaultTable, p.Name)
		var rows int64
		// Counted before the lock, which consumers wait behind.
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+qp).Scan(&rows); err != nil {
			return res, fmt.Errorf("counting ledger partition %s: %w", p.Name, err)
		}
		if !dryRun {
			_, err := pgweeks.Truncate(ctx, pool, qp, nil)
			if errors.Is(err, pgweeks.ErrLocked) {
				res.Waiting = append(res.Waiting, p.Name+": "+pgweeks.ErrLocked.Error())
				continue
			}
			if err != nil {
				return res, fmt.Errorf("clearing ledger partition %s: %w", p.Name, err)
			}
		}
		res.Partitions = append(res.Partitions, p.Name)
		res.Rows += rows
	}
	return res, nil
}

// RingTable is the one-row table that says which weeks of the ledger may
// hold rows (migration 00026).
const RingTable = "ferry_ledger_ring"

// narrowRing records the oldest week a ledger partition holds rows of
// (the current one when none does) and whether the legacy partition is
// empty. The ring's row is locked first: an insert into an older week
// (which widens it) either waits for this and widens it after, or
// committed before the partitions are read here and is counted.
func narrowRing(ctx context.Context, pool *pgxpool.Pool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit a no-op
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+RingTable+` FOR UPDATE`); err != nil {
		return fmt.Errorf("locking %s: %w", RingTable, err)
	}
	parts, now, err := Partitions(ctx, tx)
	if err != nil {
		return err
	}
	oldest, legacyEmpty := pgweeks.Week(now), true
	for _, p := range parts {
		switch {
		case p.Empty:
		case p.Part == pgweeks.Legacy:
			legacyEmpty = false
		default:
			oldest = min(oldest, pgweeks.Week(p.From))
		}
	}
	if _, err := tx.Exec(ctx, `UPDATE `+RingTable+` SET oldest_week = $1, legacy_empty = $2`, oldest, legacyEmpty); err != nil {
		return fmt.Errorf("recording the ledger's weeks in %s: %w", RingTable, err)
	}
	return tx.Commit(ctx)
}

// CountBefore counts the ledger rows (DefaultTable) processed before
// cutoff that DeleteBefore would remove: those of the legacy partition of a
// partitioned ledger (ClearPartitions has the others), or of the table.
func CountBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time) (int64, error) {
	t, err := pgweeks.LegacyRelation(ctx, pool, DefaultTable)
	if err != nil || t == "" {
		return 0, err
	}
	var n int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t+` WHERE processed_at < $1`, cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting prunable ledger rows: %w", err)
	}
	return n, nil
}

// DeleteBefore deletes at most n ledger rows processed before cutoff,
// skipping rows others hold, and says how many went: rows of the legacy
// partition of a partitioned ledger (its weeks go whole, by
// ClearPartitions), or of the table.
func DeleteBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time, n int) (int64, error) {
	t, err := pgweeks.LegacyRelation(ctx, pool, DefaultTable)
	if err != nil || t == "" {
		return 0, err
	}
	tag, err := pool.Exec(ctx, `WITH doomed AS (
		SELECT consumer, message_id FROM `+t+` WHERE processed_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)
		DELETE FROM `+t+` p USING doomed d WHERE p.consumer = d.consumer AND p.message_id = d.message_id`, cutoff, n)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// Handled is one message a consumer processed.
type Handled struct {
	Consumer, MessageID string
	ProcessedAt         time.Time
}

// Reader is a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// HandledOf returns who processed these messages (of the default ledger
// table), oldest first; consumers, if given, narrows to them (the
// ledger's key is (consumer, message): an index lookup).
func HandledOf(ctx context.Context, q Reader, messageIDs, consumers []string) ([]Handled, error) {
	if len(messageIDs) == 0 {
		return nil, nil
	}
	sql, args := `SELECT consumer, message_id, processed_at FROM `+DefaultTable+` WHERE message_id = ANY($1)`, []any{messageIDs}
	if len(consumers) > 0 {
		sql, args = sql+` AND consumer = ANY($2)`, append(args, consumers)
	}
	rows, err := q.Query(ctx, sql+` ORDER BY processed_at`, args...)
	if err != nil {
		return nil, fmt.Errorf("reading the ledger: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Handled])
}

// takeOverCheck is how often a ledger statement still waiting looks at
// what holds it: a statement that waits on nothing answers in
// milliseconds, so the first look costs nothing on the common path.
const takeOverCheck = time.Second

// takeOverSQL ends the sessions whose transactions hold what the ledger
// statement of backend $1 waits for, the same message's ledger key (an
// advisory lock, taken by the ledger's trigger, or the uncommitted row's
// transaction on a ledger without it), and that have sent nothing for $2
// ms. A wait on a table lock (a migration, a partition drop) is never
// taken over.
const takeOverSQL = `WITH silent AS (
	SELECT a.pid, a.application_name, extract(epoch FROM now() - a.state_change)::float8 AS silent_for
	FROM pg_stat_activity a
	WHERE a.pid = ANY (pg_blocking_pids($1))
		AND EXISTS (SELECT FROM pg_locks w WHERE w.pid = $1 AND NOT w.granted AND w.locktype IN ('advisory', 'transactionid'))
		AND a.state IN ('idle in transaction', 'idle in transaction (aborted)')
		AND a.state_change < now() - $2 * interval '1 millisecond')
SELECT pid, application_name, silent_for, pg_terminate_backend(pid) FROM silent`

// watch looks, every takeOverCheck until stop is called, at what the
// ledger statement of backend pid waits for, and takes over silent
// holders (takeOverSQL). Written by hand: PostgreSQL ends an idle
// transaction only by a session-wide timeout
// (idle_in_transaction_session_timeout), which would also end a
// handler's slow external call that nobody waits on; here only a
// transaction another delivery of the same message waits on is ended.
func (l *Ledger) watch(ctx context.Context, pid uint32) (stop func()) {
	var mu sync.Mutex
	stopped := false
	var timer *time.Timer
	mu.Lock()
	defer mu.Unlock()
	timer = time.AfterFunc(takeOverCheck, func() {
		l.takeOver(ctx, pid)
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			timer.Reset(takeOverCheck)
		}
	})
	return func() {
		mu.Lock()
		defer mu.Unlock()
		stopped = true
		timer.Stop()
	}
}

// takeOver ends the silent holders of what backend pid waits for.
func (l *Ledger) takeOver(ctx context.Context, pid uint32) {
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), takeOverCheck)
	defer cancel()
	rows, err := l.pool.Query(qctx, takeOverSQL, pid, l.takeOverAfter.Milliseconds())
	if err != nil {
		l.logger.WarnContext(ctx, "a ledger insert waits on another transaction; cannot look at it", "error", pipeline.ErrorText(err, 300))
		return
	}
	var holder int32
	var app string
	var silent float64
	var ended bool
	_, err = pgx.ForEachRow(rows, []any{&holder, &app, &silent, &ended}, func() error {
		if ended {
			l.logger.WarnContext(ctx, "ended a silent transaction holding the ledger row another delivery of its message waits on (its process lost the database, or hangs); the delivery is handled here, its effects keyed by the message id",
				"holder_pid", holder, "holder_application", app, "silent_seconds", silent)
		} else {
			l.logger.WarnContext(ctx, "a silent transaction holds a ledger row another delivery of its message waits on, and this role may not end its session (pg_signal_backend)",
				"holder_pid", holder, "holder_application", app, "silent_seconds", silent)
		}
		return nil
	})
	if err != nil {
		l.logger.WarnContext(ctx, "a ledger insert waits on another transaction; cannot take it over", "error", pipeline.ErrorText(err, 300))
	}
}
