package pgoutbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
)

// Querier is what a business write needs of the transaction InTx runs it
// in. Every statement runs inside that transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	// SendBatch sends b's statements in one round trip, as pgx.Conn's does.
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	// CopyFrom is pgx's bulk load. It cannot share a round trip, so when it
	// is the transaction's first statement BEGIN costs one.
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
	// Tx is the transaction as a pgx.Tx, for code written against one (it
	// begins the transaction now if no statement has). InTx commits it:
	// ending it with Commit or Rollback makes InTx fail without writing
	// the events.
	Tx(ctx context.Context) (pgx.Tx, error)
}

// Pending collects the events of an InTx transaction: they are written
// with its COMMIT, in the same network round trip.
type Pending struct {
	o       *Outbox
	capture *capturing
}

// PublishEvents queues events of any topics (as PublishEventsTx does):
// Watermill's SQL publisher builds their INSERT now, and it is sent with
// the COMMIT. Invalid events are refused here, before anything is sent.
func (p *Pending) PublishEvents(ctx context.Context, events ...pipeline.Outgoing) error {
	return p.o.PublishEventsTx(ctx, p.capture, events...)
}

// Publish queues one event on topic (pipeline.NewEvent(ctx, aggregateID,
// payload) and PublishEvents in one call).
func (p *Pending) Publish(ctx context.Context, topic, aggregateID string, payload any) error {
	evt, err := pipeline.NewEvent(ctx, aggregateID, payload)
	if err != nil {
		return err
	}
	return p.PublishEvents(ctx, pipeline.Outgoing{Topic: topic, Msg: evt})
}

// Queue adds a statement to send with the events and the COMMIT (in the
// order queued, events and statements alike), for a write whose result
// the function does not need (a status row, a stored response): it costs
// no round trip of its own. Its failure rolls the whole transaction back,
// as a failed event INSERT does.
func (p *Pending) Queue(sql string, args ...any) {
	p.capture.batch.Queue(sql, args...)
}

// capturing is the executor Watermill's publisher writes to inside InTx:
// it keeps the statement for the commit's round trip instead of sending
// it. Written by hand because watermill-sql knows only executors that
// execute.
type capturing struct {
	batch pgx.Batch
}

func (c *capturing) ExecContext(_ context.Context, query string, args ...any) (sql.Result, error) {
	c.batch.Queue(query, args...)
	return pgxResult(0), nil
}

func (c *capturing) Exec(query string, args ...any) (sql.Result, error) {
	return c.ExecContext(context.Background(), query, args...)
}

func (c *capturing) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	return nil, errPgxQuery
}

func (c *capturing) Query(string, ...any) (*sql.Rows, error) { return nil, errPgxQuery }

func (c *capturing) QueryRowContext(context.Context, string, ...any) *sql.Row { return nil }

func (c *capturing) QueryRow(string, ...any) *sql.Row { return nil }

// lazyTx is the Querier InTx hands to fn: BEGIN goes in the same pipeline
// as fn's first statement (pgx's Batch.BeginTx) instead of in a round trip
// of its own. The pipeline keeps the order, BEGIN then the statement, under
// one Sync, so the statement runs inside the transaction exactly as after
// an eager BEGIN; a statement that fails leaves the transaction aborted,
// and InTx rolls it back. Every later statement goes through the pgx.Tx,
// so pgx refuses them once fn has ended the transaction itself.
type lazyTx struct {
	conn *pgx.Conn
	tx   pgx.Tx // nil until begun
	// open is the batch behind a Query or QueryRow that carried BEGIN: it
	// is finished (its Sync read) before the connection is used again.
	open pgx.BatchResults
	// err is how finishing it failed after its rows were read; every
	// later statement and the commit report it.
	err error
}

// finish reads what is left of the batch that carried BEGIN.
func (t *lazyTx) finish() error {
	if t.open != nil {
		t.err = t.open.Close()
		t.open = nil
	}
	return t.err
}

// begun is the transaction once BEGIN went out, for the next statement.
func (t *lazyTx) begun() (pgx.Tx, error) {
	if err := t.finish(); err != nil {
		return nil, err
	}
	return t.tx, nil
}

// Tx begins the transaction on its own round trip if nothing has yet.
func (t *lazyTx) Tx(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.begun()
	if err != nil || tx != nil {
		return tx, err
	}
	if t.tx, err = t.conn.Begin(ctx); err != nil {
		t.tx = nil
		return nil, fmt.Errorf("beginning transaction: %w", err)
	}
	return t.tx, nil
}

// simple reports an Exec pgx sends as a simple query (no arguments: it
// may hold several statements, which a pipeline refuses) or with pgx's
// per-query options, which a batch does not take: those begin on their
// own round trip.
func simple(args []any) bool {
	if len(args) == 0 {
		return true
	}
	switch args[0].(type) {
	case pgx.QueryExecMode, pgx.QueryRewriter:
		return true
	}
	return false
}

// beginWith sends BEGIN and queued in one pipeline and returns the
// results positioned after BEGIN's.
func (t *lazyTx) beginWith(ctx context.Context, queued ...*pgx.QueuedQuery) (pgx.BatchResults, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.QueuedQueries = append(b.QueuedQueries, queued...)
	br := t.conn.SendBatch(ctx, b)
	t.tx = br.Tx()
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return nil, fmt.Errorf("beginning transaction: %w", err)
	}
	return br, nil
}

func (t *lazyTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tx, err := t.begun()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	if tx != nil || simple(args) {
		if tx, err = t.Tx(ctx); err != nil {
			return pgconn.CommandTag{}, err
		}
		return tx.Exec(ctx, sql, args...)
	}
	br, err := t.beginWith(ctx, &pgx.QueuedQuery{SQL: sql, Arguments: args})
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func (t *lazyTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	tx, err := t.begun()
	if err != nil {
		return nil, err
	}
	if tx != nil || (len(args) > 0 && simple(args)) {
		if tx, err = t.Tx(ctx); err != nil {
			return nil, err
		}
		return tx.Query(ctx, sql, args...)
	}
	br, err := t.beginWith(ctx, &pgx.QueuedQuery{SQL: sql, Arguments: args})
	if err != nil {
		return nil, err
	}
	t.open = br
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	return &batchRows{Rows: rows, tx: t}, nil
}

func (t *lazyTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	tx, err := t.begun()
	if err != nil {
		return errRow{err}
	}
	if tx != nil {
		return tx.QueryRow(ctx, sql, args...)
	}
	rows, err := t.Query(ctx, sql, args...)
	if err != nil {
		return errRow{err}
	}
	return &firstRow{rows: rows}
}

func (t *lazyTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	tx, err := t.begun()
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	if tx != nil || b == nil {
		if tx, err = t.Tx(ctx); err != nil {
			return pgx.FailedBatchResults(b, err)
		}
		return tx.SendBatch(ctx, b)
	}
	// The caller's queued statements, callbacks and all, behind BEGIN.
	br, err := t.beginWith(ctx, b.QueuedQueries...)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return br
}

func (t *lazyTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	tx, err := t.Tx(ctx)
	if err != nil {
		return 0, err
	}
	return tx.CopyFrom(ctx, table, columns, src)
}

// batchRows is the rows of a Query that carried BEGIN: closing them also
// finishes the batch, so the connection is ready for the next statement.
type batchRows struct {
	pgx.Rows
	tx *lazyTx
}

func (r *batchRows) Close() {
	r.Rows.Close()
	// An error here is kept for the next statement and the commit: the
	// pipeline failed after the rows, and the transaction is rolled back.
	_ = r.tx.finish()
}

// firstRow is pgx's QueryRow contract over batchRows: the first row, or
// pgx.ErrNoRows.
type firstRow struct{ rows pgx.Rows }

func (r *firstRow) Scan(dest ...any) error {
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// InTx runs fn in a transaction on a connection of pool, and writes the
// events fn queued on p in the same network round trip as the COMMIT: the
// outbox costs the bytes of its INSERT, not a round trip of its own. BEGIN
// rides on fn's first statement too, so a transaction of one business
// statement and its events takes two round trips where pgx.BeginFunc
// takes three without the events.
//
// Atomicity is the transaction's, as with PublishTx: fn's error, a failed
// statement, a failed INSERT or a failed COMMIT leave neither the business
// rows nor the events. The events and the COMMIT are one pipeline with
// one Sync, so when an INSERT fails the COMMIT is not run and the
// transaction is rolled back. A function that writes nothing and queues
// no event costs no round trip.
func (o *Outbox) InTx(ctx context.Context, pool *pgxpool.Pool, fn func(ctx context.Context, q Querier, p *Pending) error) (err error) {
	if pool == nil || fn == nil {
		return errors.New("pgoutbox: InTx needs a pool and a function")
	}
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquiring a connection: %w", err)
	}
	// pgxpool puts a connection back only when it is idle (outside any
	// transaction, not busy) and closes it otherwise, so Release is right
	// on every path once the transaction is over or rolled back.
	defer pc.Release()
	lt := &lazyTx{conn: pc.Conn()}
	committed := false
	defer func() {
		ferr := lt.finish()
		if lt.tx == nil || committed {
			if ferr != nil {
				_ = pc.Conn().Close(context.WithoutCancel(ctx))
			}
			return
		}
		// The error that got us here is the one to report. pgx closes a
		// connection whose rollback fails.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = lt.tx.Rollback(rctx)
	}()
	p := &Pending{o: o, capture: &capturing{}}
	if err := fn(ctx, lt, p); err != nil {
		return err
	}
	if err := lt.finish(); err != nil {
		return err
	}
	queued := p.capture.batch.QueuedQueries
	if lt.tx == nil && len(queued) == 0 {
		return nil
	}
	commit := &pgx.QueuedQuery{SQL: "COMMIT"}
	var res pgx.BatchResults
	if lt.tx == nil {
		// Events only: BEGIN, the INSERTs and COMMIT in one round trip.
		if res, err = lt.beginWith(ctx, append(queued, commit)...); err != nil {
			return err
		}
	} else {
		// Through the pgx.Tx: pgx refuses it if fn ended the transaction.
		res = lt.tx.SendBatch(ctx, &pgx.Batch{QueuedQueries: append(queued, commit)})
	}
	for i := range queued {
		if _, err := res.Exec(); err != nil {
			_ = res.Close()
			return fmt.Errorf("writing statement %d of the events with the commit: %w", i, err)
		}
	}
	tag, err := res.Exec()
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("committing: %w", err)
	}
	// The COMMIT went in the pipeline, past the pgx.Tx, which is left
	// behind: the connection is idle again and goes back to the pool.
	committed = true
	if tag.String() != "COMMIT" {
		// COMMIT of an aborted transaction answers ROLLBACK.
		return fmt.Errorf("committing: the server rolled the transaction back (%s)", tag.String())
	}
	if len(queued) > 0 {
		o.Committed()
	}
	return nil
}
