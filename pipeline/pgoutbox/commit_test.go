package pgoutbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pipelinetest"
)

// InTx writes the events with the COMMIT, and keeps the outbox's contract:
// both or neither, whichever side fails.
func TestInTxWritesEventsWithTheCommitAtomically(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE things (id bigserial PRIMARY KEY, name text NOT NULL UNIQUE)`)
	require.NoError(t, err)
	ob := pipelinetest.Outbox(t)
	count := func() (things, events int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM things), (SELECT count(*) FROM outbox)`).Scan(&things, &events))
		return
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

	missing, err := pgoutbox.New(pgoutbox.SchemaAdapter{Table: "no_such_outbox"}, nil)
	require.NoError(t, err)
	require.Error(t, write(missing, "c", nil), "the event INSERT fails in the commit's round trip")
	n, e = count()
	require.Equal(t, [2]int{1, 2}, [2]int{n, e}, "a failed event INSERT leaves no business row")

	// The connection went back to the pool usable.
	require.NoError(t, write(ob, "d", nil))
	n, e = count()
	require.Equal(t, [2]int{2, 4}, [2]int{n, e})
}
