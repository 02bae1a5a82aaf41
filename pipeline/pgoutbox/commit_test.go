package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// thingsDB is a test schema with a business table of its own, things.
func thingsDB(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := pipelinetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE things (id bigserial PRIMARY KEY, name text NOT NULL UNIQUE)`)
	require.NoError(t, err)
	return pool
}

// InTx writes the events with the COMMIT, and keeps the outbox's contract:
// both or neither, whichever side fails.
func TestInTxWritesEventsWithTheCommitAtomically(t *testing.T) {
	t.Parallel()
	pool := thingsDB(t)
	ctx := context.Background()
	ob := pipelinetest.Outbox(t)
	count := func() (things, events int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM things`).Scan(&things))
		return things, countWhere(t, pool, "")
	}
	write := func(o *pgoutbox.Outbox, name string, fail error) error {
		return o.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
			var id int64
			if err := q.QueryRow(ctx, `INSERT INTO things (name) VALUES ($1) RETURNING id`, name).Scan(&id); err != nil {
				return err
			}
			a := message.NewMessage("e-"+name, []byte(`{"n":1}`))
			b := message.NewMessage("f-"+name, []byte(`{"n":2}`))
			if err := p.PublishEvents(ctx, pipeline.Outgoing{Topic: "thing.made", Msg: a}, pipeline.Outgoing{Topic: "thing.mailed", Msg: b}); err != nil {
				return err
			}
			return fail
		})
	}
	require.NoError(t, write(ob, "a", nil))
	n, e := count()
	require.Equal(t, [2]int{1, 2}, [2]int{n, e}, "the row and both events")

	boom := errors.New("business rule says no")
	require.ErrorIs(t, write(ob, "b", boom), boom)
	n, e = count()
	require.Equal(t, [2]int{1, 2}, [2]int{n, e}, "a failed business step leaves no event (and no row)")

	require.Error(t, write(ob, "a", nil), "the business write fails (unique name)")
	n, e = count()
	require.Equal(t, [2]int{1, 2}, [2]int{n, e}, "a failed business write leaves no outbox row")

	missing, err := pgoutbox.New(pgoutbox.Config{Table: mustTable(t, "no_such_outbox")}, nil)
	require.NoError(t, err)
	require.Error(t, write(missing, "c", nil), "the event INSERT fails in the commit's round trip")
	n, e = count()
	require.Equal(t, [2]int{1, 2}, [2]int{n, e}, "a failed event INSERT leaves no business row")

	// The connection went back to the pool usable.
	require.NoError(t, write(ob, "d", nil))
	n, e = count()
	require.Equal(t, [2]int{2, 4}, [2]int{n, e})
}

// InTx sends BEGIN with the first statement and the events with the
// COMMIT: a business statement and its events cost two round trips, and
// the statement runs inside the transaction.
func TestInTxBeginsWithTheFirstStatement(t *testing.T) {
	t.Parallel()
	base := thingsDB(t)
	ctx := context.Background()
	pool, tr := pipelinetest.CountingPool(t, base)
	ob := pipelinetest.Outbox(t)
	event := func(name string) pipeline.Outgoing {
		return pipeline.Outgoing{Topic: "thing.made", Msg: message.NewMessage("e-"+name, []byte(`{"n":1}`))}
	}
	oneAndEvent := func(name string) error {
		return ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
			var id int64
			if err := q.QueryRow(ctx, `INSERT INTO things (name) VALUES ($1) RETURNING id`, name).Scan(&id); err != nil {
				return err
			}
			return p.PublishEvents(ctx, event(name))
		})
	}
	// Warm up: pgx prepares each statement once per connection.
	require.NoError(t, oneAndEvent("warm"))
	tr.Take()

	require.NoError(t, oneAndEvent("a"))
	queries, batches := tr.Take()
	require.Equal(t, [2]int{0, 2}, [2]int{len(queries), batches}, "one batch with BEGIN, one with the COMMIT; queries sent: %q", queries)

	require.NoError(t, ob.InTx(ctx, pool, func(ctx context.Context, _ pgoutbox.Querier, p *pgoutbox.Pending) error {
		return p.PublishEvents(ctx, event("only"))
	}))
	queries, batches = tr.Take()
	require.Equal(t, [2]int{0, 1}, [2]int{len(queries), batches}, "events alone: BEGIN, INSERT and COMMIT in one round trip")

	require.NoError(t, ob.InTx(ctx, pool, func(context.Context, pgoutbox.Querier, *pgoutbox.Pending) error { return nil }))
	queries, batches = tr.Take()
	require.Equal(t, [2]int{0, 0}, [2]int{len(queries), batches}, "nothing to write: nothing sent")

	// The first statement and the later ones are one transaction.
	require.NoError(t, ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, _ *pgoutbox.Pending) error {
		var first, second int64
		require.NoError(t, q.QueryRow(ctx, `SELECT txid_current()`).Scan(&first))
		require.NoError(t, q.QueryRow(ctx, `SELECT txid_current()`).Scan(&second))
		require.Equal(t, first, second, "the first statement runs inside the transaction")
		return nil
	}))
	require.Equal(t, 3, countWhere(t, base, ""))

	// After the first statement, the pgx.Tx costs no round trip, and it is
	// the same transaction.
	tr.Take()
	require.NoError(t, ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
		var first, second int64
		if err := q.QueryRow(ctx, `SELECT txid_current()`).Scan(&first); err != nil {
			return err
		}
		tx, err := q.Tx(ctx)
		if err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&second); err != nil {
			return err
		}
		require.Equal(t, first, second)
		return p.PublishEvents(ctx, event("tx"))
	}))
	queries, batches = tr.Take()
	require.Equal(t, [2]int{1, 2}, [2]int{len(queries), batches}, "BEGIN with the first, the second, the events with the COMMIT: %q", queries)

	// A function that ends the transaction itself gets an error, and its
	// events are not written.
	for _, end := range []func(pgx.Tx) error{
		func(tx pgx.Tx) error { return tx.Rollback(ctx) },
		func(tx pgx.Tx) error { return tx.Commit(ctx) },
	} {
		err := ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
			if _, err := q.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, fmt.Sprintf("ended-%p", end)); err != nil {
				return err
			}
			tx, err := q.Tx(ctx)
			if err != nil {
				return err
			}
			if err := p.PublishEvents(ctx, event(fmt.Sprintf("ended-%p", end))); err != nil {
				return err
			}
			return end(tx)
		})
		require.ErrorIs(t, err, pgx.ErrTxClosed)
	}
	require.Zero(t, countWhere(t, base, "message_uuid LIKE 'e-ended-%'"), "no event of a transaction the function ended")
}

// Whichever call carries BEGIN, the statement is inside the transaction:
// fn's error takes it back, success commits it with the event, and the
// connection goes back to the pool outside any transaction.
func TestInTxFirstStatementOfEveryKindIsAtomic(t *testing.T) {
	t.Parallel()
	base := thingsDB(t)
	ctx := context.Background()
	pool, _ := pipelinetest.CountingPool(t, base)
	ob := pipelinetest.Outbox(t)
	first := map[string]func(ctx context.Context, q pgoutbox.Querier, name string) error{
		"exec": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			_, err := q.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, name)
			return err
		},
		"exec, no arguments, two statements": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			_, err := q.Exec(ctx, fmt.Sprintf(`INSERT INTO things (name) VALUES ('%s'); INSERT INTO things (name) VALUES ('%s-2')`, name, name))
			return err
		},
		"exec with a pgx option": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			_, err := q.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, pgx.QueryExecModeSimpleProtocol, name)
			return err
		},
		"query": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			rows, err := q.Query(ctx, `INSERT INTO things (name) VALUES ($1), ($1 || '-2') RETURNING id`, name)
			if err != nil {
				return err
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err == nil && len(ids) != 2 {
				err = fmt.Errorf("%d ids", len(ids))
			}
			return err
		},
		"query row, never scanned": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			_ = q.QueryRow(ctx, `INSERT INTO things (name) VALUES ($1) RETURNING id`, name)
			return nil
		},
		"send batch": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO things (name) VALUES ($1)`, name)
			var id int64
			b.Queue(`INSERT INTO things (name) VALUES ($1) RETURNING id`, name+"-2").QueryRow(func(r pgx.Row) error { return r.Scan(&id) })
			if err := q.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			if id == 0 {
				return errors.New("the batch's callback did not run")
			}
			return nil
		},
		"the pgx.Tx": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			tx, err := q.Tx(ctx)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, name)
			return err
		},
		"copy from": func(ctx context.Context, q pgoutbox.Querier, name string) error {
			n, err := q.CopyFrom(ctx, pgx.Identifier{"things"}, []string{"name"}, pgx.CopyFromRows([][]any{{name}}))
			if err == nil && n != 1 {
				err = fmt.Errorf("copied %d rows", n)
			}
			return err
		},
	}
	boom := errors.New("business rule says no")
	names := func(prefix string) (things, events int) {
		require.NoError(t, base.QueryRow(ctx, `SELECT count(*) FROM things WHERE name LIKE $1 || '%'`, prefix).Scan(&things))
		return things, countWhere(t, base, "message_uuid LIKE 'e-' || $1 || '%'", prefix)
	}
	idle := func() {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer c.Release()
		require.Equal(t, byte('I'), c.Conn().PgConn().TxStatus(), "the connection went back outside a transaction")
	}
	i := 0
	for kind, write := range first {
		i++
		name := fmt.Sprintf("k%d", i)
		run := func(fail error, suffix string) error {
			return ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
				if err := write(ctx, q, name+suffix); err != nil {
					return err
				}
				if err := p.PublishEvents(ctx, pipeline.Outgoing{Topic: "thing.made", Msg: message.NewMessage("e-"+name+suffix, []byte(`{}`))}); err != nil {
					return err
				}
				return fail
			})
		}
		require.ErrorIs(t, run(boom, "x"), boom, kind)
		things, events := names(name + "x")
		require.Equal(t, [2]int{0, 0}, [2]int{things, events}, "%s: fn's error takes the first statement back", kind)
		idle()

		require.NoError(t, run(nil, "y"), kind)
		things, events = names(name + "y")
		require.NotZero(t, things, "%s: committed", kind)
		require.Equal(t, 1, events, "%s: the event with it", kind)
		idle()

		require.Error(t, run(nil, "y"), "%s: the same names again fail on the unique key", kind)
		things, events = names(name + "y")
		require.Equal(t, 1, events, "%s: a failed first statement writes no event", kind)
		idle()
	}
}

func mustTable(t testing.TB, name string) pgoutbox.Table {
	t.Helper()
	tbl, err := pgoutbox.ParseTable(name)
	if err != nil {
		t.Fatal(err)
	}
	return tbl
}
