package pgledger_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func TestOnceRunsConcurrentDeliveriesOnce(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)

	var runs atomic.Int32
	var wg sync.WaitGroup
	ran := make([]bool, 4)
	errs := make([]error, 4)
	for i := range ran {
		wg.Go(func() {
			ran[i], errs[i] = ledger.Once(context.Background(), "payments", "msg-1", nil, func(ctx context.Context) error {
				runs.Add(1)
				time.Sleep(100 * time.Millisecond) // hold the ledger row while the others arrive
				return nil
			})
		})
	}
	wg.Wait()
	require.EqualValues(t, 1, runs.Load())
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.ElementsMatch(t, []bool{true, false, false, false}, ran)
}

func TestOnceFailureRollsBackHandlerWrites(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effects (note text)`)
	require.NoError(t, err)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)

	boom := errors.New("provider down")
	ran, err := ledger.Once(ctx, "c", "m", nil, func(ctx context.Context) error {
		_, err := pgledger.TxFromContext(ctx).Exec(ctx, `INSERT INTO effects VALUES ('first try')`)
		require.NoError(t, err)
		return boom
	})
	require.True(t, ran)
	require.ErrorIs(t, err, boom)
	processed, err := ledger.Processed(ctx, "c", "m")
	require.NoError(t, err)
	require.False(t, processed, "a failed attempt must not be recorded")

	// The redelivery runs again and, this time, commits its write with the ledger row.
	ran, err = ledger.Once(ctx, "c", "m", nil, func(ctx context.Context) error {
		_, err := pgledger.TxFromContext(ctx).Exec(ctx, `INSERT INTO effects VALUES ('second try')`)
		return err
	})
	require.True(t, ran)
	require.NoError(t, err)
	var notes []string
	rows, err := pool.Query(ctx, `SELECT note FROM effects`)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		notes = append(notes, n)
	}
	require.Equal(t, []string{"second try"}, notes)

	// Another consumer of the same message is independent.
	ran, err = ledger.Once(ctx, "other", "m", nil, func(context.Context) error { return nil })
	require.NoError(t, err)
	require.True(t, ran)
}

func TestOncePanicLeavesNoLedgerRow(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	require.Panics(t, func() {
		_, _ = ledger.Once(context.Background(), "c", "m", nil, func(context.Context) error { panic("handler bug") })
	})
	processed, err := ledger.Processed(context.Background(), "c", "m")
	require.NoError(t, err)
	require.False(t, processed)
}

func TestOnceRejectsEmptyKeys(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	_, err = ledger.Once(context.Background(), "c", "", nil, func(context.Context) error { return nil })
	require.Error(t, err)
}

// A processed id that comes back with other content is an error, not a
// silent duplicate; the same content is a duplicate.
func TestOnceReportsSameIDDifferentContent(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	a, b := sha256.Sum256([]byte(`{"to":"a"}`)), sha256.Sum256([]byte(`{"to":"b"}`))
	ran, err := ledger.Once(ctx, "mail", "m-1", a[:], func(context.Context) error { return nil })
	require.NoError(t, err)
	require.True(t, ran)

	ran, err = ledger.Once(ctx, "mail", "m-1", a[:], func(context.Context) error { t.Fatal("a duplicate runs nothing"); return nil })
	require.NoError(t, err)
	require.False(t, ran, "same id, same content: a redelivery")

	ran, err = ledger.Once(ctx, "mail", "m-1", b[:], func(context.Context) error { t.Fatal("a conflict runs nothing"); return nil })
	require.ErrorIs(t, err, pipeline.ErrIDConflict)
	require.False(t, ran)
	require.Contains(t, err.Error(), "m-1")
}

// The ledger's own database failing is marked as infrastructure: the
// message is not at fault.
func TestOnceMarksDatabaseFailuresAsInfrastructure(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	ctx := context.Background()

	// The handler's connection is terminated under it.
	_, err = ledger.Once(ctx, "c", "killed", nil, func(ctx context.Context) error {
		tx := pgledger.TxFromContext(ctx)
		_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
		return err
	})
	require.Error(t, err)
	require.True(t, pipeline.IsInfrastructure(err), "a terminated ledger connection is infrastructure: %v", err)

	// A handler's own refusal is not.
	_, err = ledger.Once(ctx, "c", "refused", nil, func(context.Context) error { return errors.New("provider said no") })
	require.Error(t, err)
	require.False(t, pipeline.IsInfrastructure(err))

	// The database gone altogether.
	pool.Close()
	_, err = ledger.Once(ctx, "c", "gone", nil, func(context.Context) error { return nil })
	require.Error(t, err)
	require.True(t, pipeline.IsInfrastructure(err), "%v", err)
}

// BEGIN rides on the ledger row's INSERT: a delivery whose handler writes
// nothing costs two round trips (BEGIN+INSERT, COMMIT; three before), a
// duplicate three (BEGIN+INSERT, the stored digest, ROLLBACK); on every
// path the pool gets its one connection back.
func TestOnceRoundTrips(t *testing.T) {
	t.Parallel()
	base := pipelinetest.Postgres(t)
	pool, rt := pipelinetest.CountingPool(t, base)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	digest := sha256.Sum256([]byte("payload"))
	noop := func(context.Context) error { return nil }
	// Warm up: pgx prepares each statement once per connection.
	_, err = ledger.Once(ctx, "c", "warm", digest[:], noop)
	require.NoError(t, err)
	_, err = ledger.Once(ctx, "c", "warm", digest[:], noop)
	require.NoError(t, err)
	rt.Take()

	ran, err := ledger.Once(ctx, "c", "m1", digest[:], noop)
	require.NoError(t, err)
	require.True(t, ran)
	queries, batches := rt.Take()
	require.Equal(t, [2]int{1, 1}, [2]int{len(queries), batches}, "BEGIN+INSERT in a batch, then COMMIT: %q", queries)

	ran, err = ledger.Once(ctx, "c", "m1", digest[:], noop)
	require.NoError(t, err)
	require.False(t, ran)
	queries, batches = rt.Take()
	require.Equal(t, [2]int{2, 1}, [2]int{len(queries), batches}, "BEGIN+INSERT, the digest, the rollback: %q", queries)

	_, err = ledger.Once(ctx, "c", "m2", digest[:], func(context.Context) error { return errors.New("no") })
	require.Error(t, err)
	require.Equal(t, int32(0), pool.Stat().AcquiredConns(), "the connection is back after a failed handler")
	ran, err = ledger.Once(ctx, "c", "m2", digest[:], noop)
	require.NoError(t, err)
	require.True(t, ran, "the failed attempt left no ledger row")
	require.Equal(t, int32(0), pool.Stat().AcquiredConns())
}

// Same id, same payload, other content metadata (another tenant) is not a
// redelivery: the ledger reports it. A redelivery that differs only in
// how it was delivered or traced is one. A ledger row written before
// metadata counted (the payload's SHA-256) still recognises its message.
func TestOnceComparesContentMetadata(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	msg := func(tenant string, extra ...string) *message.Message {
		m := message.NewMessage("m-1", []byte(`{"amount":100}`))
		m.Metadata.Set(pipeline.MetaTenantID, tenant)
		for i := 0; i+1 < len(extra); i += 2 {
			m.Metadata.Set(extra[i], extra[i+1])
		}
		return m
	}
	ran, err := ledger.Once(ctx, "charge", "m-1", pipeline.ContentDigest(msg("acme")), func(context.Context) error { return nil })
	require.NoError(t, err)
	require.True(t, ran)

	ran, err = ledger.Once(ctx, "charge", "m-1", pipeline.ContentDigest(msg("acme", "x-delivery-count", "2", pipeline.MetaCorrelationID, "c-9")),
		func(context.Context) error { t.Fatal("a redelivery runs nothing"); return nil })
	require.NoError(t, err)
	require.False(t, ran)

	ran, err = ledger.Once(ctx, "charge", "m-1", pipeline.ContentDigest(msg("evil")),
		func(context.Context) error { t.Fatal("another tenant's message runs nothing"); return nil })
	require.ErrorIs(t, err, pipeline.ErrIDConflict)
	require.False(t, ran)

	legacy := sha256.Sum256([]byte(`{"amount":100}`))
	_, err = pool.Exec(ctx, `INSERT INTO processed_messages (consumer, message_id, payload_sha256) VALUES ('charge', 'old', $1)`, legacy[:])
	require.NoError(t, err)
	old := msg("acme")
	old.UUID = "old"
	ran, err = ledger.Once(ctx, "charge", "old", pipeline.ContentDigest(old), func(context.Context) error { t.Fatal("processed before the upgrade"); return nil })
	require.NoError(t, err)
	require.False(t, ran)
}

// Ids the database cannot store are refused before the transaction, not
// sent to fail there (which would read as the database failing).
func TestOnceRefusesUnstorableIDs(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	for _, id := range []string{"a\x00b", "caf\xe9"} {
		_, err = ledger.Once(context.Background(), "c", id, nil, func(context.Context) error { t.Fatal("never runs"); return nil })
		require.Error(t, err)
		require.False(t, pipeline.IsInfrastructure(err))
	}
}

func TestOnceBatchRecordsTheNewAndReportsDuplicatesAndConflicts(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effects (id text)`)
	require.NoError(t, err)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	digest := func(s string) []byte { d := sha256.Sum256([]byte(s)); return d[:] }
	project := func(entries []pipeline.LedgerEntry) func(ctx context.Context, fresh []int) error {
		return func(ctx context.Context, fresh []int) error {
			for _, i := range fresh {
				if _, err := pgledger.TxFromContext(ctx).Exec(ctx, `INSERT INTO effects VALUES ($1)`, entries[i].MessageID); err != nil {
					return err
				}
			}
			return nil
		}
	}

	first := []pipeline.LedgerEntry{{MessageID: "a", Digest: digest("A")}, {MessageID: "b", Digest: digest("B")}}
	res, err := ledger.OnceBatch(ctx, "proj", first, project(first))
	require.NoError(t, err)
	require.Equal(t, []pipeline.LedgerResult{{Ran: true}, {Ran: true}}, res)

	// a again (same content: a duplicate), b with other content (a
	// conflict), c new: fn sees c alone.
	second := []pipeline.LedgerEntry{{MessageID: "a", Digest: digest("A")}, {MessageID: "b", Digest: digest("B2")}, {MessageID: "c", Digest: digest("C")}}
	var saw []int
	res, err = ledger.OnceBatch(ctx, "proj", second, func(ctx context.Context, fresh []int) error {
		saw = fresh
		return project(second)(ctx, fresh)
	})
	require.NoError(t, err)
	require.Equal(t, []int{2}, saw)
	require.False(t, res[0].Ran)
	require.NoError(t, res[0].Err)
	require.False(t, res[1].Ran)
	require.ErrorIs(t, res[1].Err, pipeline.ErrIDConflict)
	require.True(t, res[2].Ran)

	// Another consumer has its own ledger: the same ids are new to it.
	res, err = ledger.OnceBatch(ctx, "audit", first, func(context.Context, []int) error { return nil })
	require.NoError(t, err)
	require.True(t, res[0].Ran && res[1].Ran)

	// fn's error rolls back the rows and the writes of the whole batch.
	third := []pipeline.LedgerEntry{{MessageID: "d"}, {MessageID: "e"}}
	boom := errors.New("projection failed")
	_, err = ledger.OnceBatch(ctx, "proj", third, func(ctx context.Context, fresh []int) error {
		require.NoError(t, project(third)(ctx, fresh))
		return boom
	})
	require.ErrorIs(t, err, boom)
	for _, id := range []string{"d", "e"} {
		done, err := ledger.Processed(ctx, "proj", id)
		require.NoError(t, err)
		require.False(t, done, id)
	}
	rows, err := pool.Query(ctx, `SELECT id FROM effects ORDER BY id`)
	require.NoError(t, err)
	effects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b", "c"}, effects, "each effect once, none of the failed batch")

	// Ids must be distinct and storable; nothing is written otherwise.
	_, err = ledger.OnceBatch(ctx, "proj", []pipeline.LedgerEntry{{MessageID: "f"}, {MessageID: "f"}}, func(context.Context, []int) error { return nil })
	require.ErrorContains(t, err, "twice")
	_, err = ledger.OnceBatch(ctx, "proj", []pipeline.LedgerEntry{{MessageID: "g"}, {MessageID: "bad\x00"}}, func(context.Context, []int) error { return nil })
	require.Error(t, err)
	done, err := ledger.Processed(ctx, "proj", "g")
	require.NoError(t, err)
	require.False(t, done)
}

// A batch costs two round trips whatever its size (BEGIN with the rows'
// INSERT, then COMMIT; the handler's own statements aside), three when
// some of it was processed before (their digests); database failures are
// infrastructure, as Once's are.
func TestOnceBatchRoundTripsAndFailures(t *testing.T) {
	t.Parallel()
	base := pipelinetest.Postgres(t)
	pool, rt := pipelinetest.CountingPool(t, base)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	noop := func(context.Context, []int) error { return nil }
	entries := func(prefix string, n int) []pipeline.LedgerEntry {
		out := make([]pipeline.LedgerEntry, n)
		for i := range out {
			d := sha256.Sum256([]byte(prefix))
			out[i] = pipeline.LedgerEntry{MessageID: prefix + "-" + string(rune('a'+i)), Digest: d[:]}
		}
		return out
	}
	_, err = ledger.OnceBatch(ctx, "c", entries("warm", 3), noop) // pgx prepares once per connection
	require.NoError(t, err)
	_, err = ledger.OnceBatch(ctx, "c", entries("warm", 3), noop)
	require.NoError(t, err)
	rt.Take()

	_, err = ledger.OnceBatch(ctx, "c", entries("m", 20), noop)
	require.NoError(t, err)
	queries, batches := rt.Take()
	require.Equal(t, [2]int{1, 1}, [2]int{len(queries), batches}, "BEGIN+INSERT of 20 rows in a batch, then COMMIT: %q", queries)

	_, err = ledger.OnceBatch(ctx, "c", append(entries("m", 2), entries("n", 2)...), noop)
	require.NoError(t, err)
	queries, batches = rt.Take()
	require.Equal(t, [2]int{2, 1}, [2]int{len(queries), batches}, "BEGIN+INSERT, the digests, COMMIT: %q", queries)
	require.Equal(t, int32(0), pool.Stat().AcquiredConns())

	_, err = ledger.OnceBatch(ctx, "c", entries("killed", 2), func(ctx context.Context, _ []int) error {
		_, err := pgledger.TxFromContext(ctx).Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
		return err
	})
	require.Error(t, err)
	require.True(t, pipeline.IsInfrastructure(err), "a terminated ledger connection is infrastructure: %v", err)

	_, err = ledger.OnceBatch(ctx, "c", entries("refused", 2), func(context.Context, []int) error { return errors.New("projection refused") })
	require.Error(t, err)
	require.False(t, pipeline.IsInfrastructure(err))

	pool.Close()
	_, err = ledger.OnceBatch(ctx, "c", entries("gone", 2), noop)
	require.Error(t, err)
	require.True(t, pipeline.IsInfrastructure(err), "%v", err)
}

// A delivery whose ledger row is held by a transaction gone silent (its
// process lost the database after the server took its insert, and its
// delivery came here) is handled once that transaction has been silent
// for TakeOverAfter, not when the server at last notices the connection.
func TestASilentHolderOfALedgerRowIsTakenOver(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	ledger, err := pgledger.New(pool, pgledger.Config{TakeOverAfter: 500 * time.Millisecond}, nil)
	require.NoError(t, err)

	inserted, release := make(chan struct{}), make(chan struct{})
	firstErr := make(chan error, 1)
	go func() {
		_, err := ledger.Once(ctx, "payments", "msg-1", nil, func(ctx context.Context) error {
			close(inserted)
			<-release // silent: the session is idle in its transaction
			return nil
		})
		firstErr <- err
	}()
	<-inserted
	type result struct {
		ran bool
		err error
	}
	second := make(chan result, 1)
	go func() {
		ran, err := ledger.Once(ctx, "payments", "msg-1", nil, func(context.Context) error { return nil })
		second <- result{ran, err}
	}()
	select {
	case r := <-second:
		require.NoError(t, r.err)
		require.True(t, r.ran, "the second delivery runs the handler: the silent one's insert never committed")
	case <-time.After(30 * time.Second):
		close(release)
		t.Fatal("the second delivery waited on the silent transaction instead of taking it over")
	}
	close(release)
	err = <-firstErr
	require.Error(t, err, "the silent transaction's session was ended: its commit cannot succeed")
	require.True(t, pipeline.IsInfrastructure(err), "the ended session is the database's doing, not the message's: %v", err)
	processed, err := ledger.Processed(ctx, "payments", "msg-1")
	require.NoError(t, err)
	require.True(t, processed)
}

// A holder that is busy (a statement running), or a lock on the table
// rather than on the row, is waited for, never ended.
func TestBusyHoldersAndTableLocksAreWaitedFor(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	ledger, err := pgledger.New(pool, pgledger.Config{TakeOverAfter: 200 * time.Millisecond}, nil)
	require.NoError(t, err)

	t.Run("busy holder", func(t *testing.T) {
		inserted := make(chan struct{})
		firstErr := make(chan error, 1)
		go func() {
			_, err := ledger.Once(ctx, "payments", "busy", nil, func(ctx context.Context) error {
				close(inserted)
				_, err := pgledger.TxFromContext(ctx).Exec(ctx, `SELECT pg_sleep(2.5)`)
				return err
			})
			firstErr <- err
		}()
		<-inserted
		ran, err := ledger.Once(ctx, "payments", "busy", nil, func(context.Context) error { return nil })
		require.NoError(t, err)
		require.False(t, ran, "the busy holder committed first: the second delivery is a duplicate")
		require.NoError(t, <-firstErr, "a busy holder is not ended")
	})

	t.Run("table lock", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE`)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() {
			_, err := ledger.Once(ctx, "payments", "locked", nil, func(context.Context) error { return nil })
			done <- err
		}()
		select {
		case err := <-done:
			t.Fatalf("the insert went through a table lock: %v", err)
		case <-time.After(2 * time.Second):
		}
		require.NoError(t, tx.Commit(ctx), "a table lock's session is not ended, however long it is idle")
		require.NoError(t, <-done)
	})
}
