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

// Querier is what a business write needs of the connection InTx runs it
// on: a *pgx.Conn inside the transaction InTx began.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
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

// InTx runs fn in a transaction on a connection of pool, and writes the
// events fn queued on p in the same network round trip as the COMMIT: the
// outbox costs the bytes of its INSERT, not a round trip of its own.
// Atomicity is the transaction's, as with PublishTx: fn's error, a failed
// INSERT or a failed COMMIT leave neither the business rows nor the
// events. The statements are one pipeline with one Sync, so when the
// INSERT fails the COMMIT is not run and the transaction is rolled back.
func (o *Outbox) InTx(ctx context.Context, pool *pgxpool.Pool, fn func(ctx context.Context, q Querier, p *Pending) error) (err error) {
	if pool == nil || fn == nil {
		return errors.New("pgoutbox: InTx needs a pool and a function")
	}
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquiring a connection: %w", err)
	}
	conn := pc.Conn()
	open := false
	defer func() {
		if open {
			// The error that got us here is the one to report; a
			// connection whose rollback fails is not put back.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			if _, rerr := conn.Exec(rctx, "ROLLBACK"); rerr != nil {
				_ = pc.Hijack().Close(rctx)
				cancel()
				return
			}
			cancel()
		}
		pc.Release()
	}()
	if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
		return fmt.Errorf("beginning transaction: %w", err)
	}
	open = true
	p := &Pending{o: o, capture: &capturing{}}
	if err := fn(ctx, conn, p); err != nil {
		return err
	}
	b := &p.capture.batch
	inserts := b.Len()
	b.Queue("COMMIT")
	res := conn.SendBatch(ctx, b)
	for i := range inserts {
		if _, err := res.Exec(); err != nil {
			_ = res.Close()
			return fmt.Errorf("writing event statement %d with the commit: %w", i, err)
		}
	}
	tag, err := res.Exec()
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("committing: %w", err)
	}
	open = false
	if tag.String() != "COMMIT" {
		// COMMIT of an aborted transaction answers ROLLBACK.
		return fmt.Errorf("committing: the server rolled the transaction back (%s)", tag.String())
	}
	return nil
}
