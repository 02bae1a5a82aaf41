package middleware_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// On the real ledger: a message delivered twice runs its handler once and
// counts one duplicate; a failed run records nothing, so the redelivery
// runs it; the handler's writes share the ledger's transaction; an id
// reused with other content, and a message without an id, are refused as
// Permanent (poison with the reason), never skipped as done.
func TestIdempotencyRunsEachMessageOncePerRoute(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	guard, err := middleware.NewIdempotency(ledger, nil)
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), `CREATE TABLE effects (message_id text)`)
	require.NoError(t, err)

	var runs atomic.Int64
	failFirst := atomic.Bool{}
	failFirst.Store(true)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		tx := pgledger.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effects VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if msg.UUID == "fails-once" && failFirst.Swap(false) {
			return nil, errors.New("provider 503")
		}
		return nil, nil
	}
	mws := []message.HandlerMiddleware{guard.Middleware}
	same := message.NewMessage("m-1", []byte(`{"n":1}`))
	errs := deliver(t, "billing.charge", mws, handler, same, same)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, int64(1), runs.Load())
	require.Equal(t, int64(1), guard.Duplicates())

	// The same id on another route is that route's own first delivery.
	errs = deliver(t, "mail.receipt", mws, handler, same)
	require.NoError(t, errs[0])
	require.Equal(t, int64(2), runs.Load())

	flaky := message.NewMessage("fails-once", []byte(`{}`))
	errs = deliver(t, "billing.charge", mws, handler, flaky, flaky)
	require.Error(t, errs[0])
	require.NoError(t, errs[1], "the failed run recorded nothing: the redelivery runs")
	var effects int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE message_id = 'fails-once'`).Scan(&effects))
	require.Equal(t, 1, effects, "the failed run's write rolled back with its ledger transaction")

	reused := message.NewMessage("m-1", []byte(`{"n":2}`))
	errs = deliver(t, "billing.charge", mws, handler, reused)
	require.True(t, pipeline.IsPermanent(errs[0]))
	require.ErrorIs(t, errs[0], pipeline.ErrIDConflict)

	errs = deliver(t, "billing.charge", mws, handler, message.NewMessage("", []byte(`{}`)))
	require.True(t, pipeline.IsPermanent(errs[0]), "no id: cannot be deduplicated")
	require.Equal(t, int64(4), runs.Load(), "neither the reused id nor the id-less message ran")
}
