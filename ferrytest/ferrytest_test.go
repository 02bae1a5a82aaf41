package ferrytest_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type invoiceIssued struct {
	InvoiceID int    `json:"invoice_id"`
	Customer  string `json:"customer"`
}

// fakeT records a failure instead of ending the test, to check that the
// helpers do fail when they should.
type fakeT struct {
	testing.TB
	failed string
}

func (f *fakeT) Helper()                           {}
func (f *fakeT) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

func TestRequirePublishedTxSeesTheTransactionsOwnRows(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ctx := context.Background()
	outbox := pipelinetest.Outbox(t)
	evt, err := pipeline.NewEvent(ctx, "inv-1", invoiceIssued{InvoiceID: 1, Customer: "bob"})
	require.NoError(t, err)

	// pgx transaction, uncommitted.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.NoError(t, outbox.PublishTx(ctx, pgoutbox.PgxTx(tx), "invoice.issued", evt))
	got := ferrytest.RequirePublishedTx(t, tx, "invoice.issued", map[string]any{"customer": "bob"})
	require.Equal(t, evt.UUID, got.Msg.UUID)
	require.Equal(t, "inv-1", got.AggregateID)
	require.Empty(t, ferrytest.PublishedTx(t, pool, "invoice.issued"), "not committed: other sessions see nothing")

	f := &fakeT{TB: t}
	ferrytest.RequirePublishedTx(f, tx, "invoice.issued", map[string]any{"customer": "eve"})
	require.Contains(t, f.failed, `no event on topic "invoice.issued"`)
	require.Contains(t, f.failed, `"customer":"bob"`, "the failure shows what was published")
	f = &fakeT{TB: t}
	ferrytest.RequirePublishedTx(f, tx, "invoice.paid", nil)
	require.NotEmpty(t, f.failed)

	// database/sql transaction.
	db := pgdb.SQLDB(pool)
	defer db.Close()
	stx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer stx.Rollback()
	evt2, err := pipeline.NewEvent(ctx, "inv-2", invoiceIssued{InvoiceID: 2, Customer: "ann"})
	require.NoError(t, err)
	require.NoError(t, outbox.PublishTx(ctx, stx, "invoice.issued", evt2))
	require.Equal(t, evt2.UUID, ferrytest.RequirePublishedTx(t, stx, "invoice.issued", invoiceIssued{InvoiceID: 2, Customer: "ann"}).Msg.UUID)
}

func TestRunRouteRunsTheHandlerInItsMiddleware(t *testing.T) {
	t.Parallel()
	var key string
	var wrapped atomic.Bool
	route := handlers.Route{
		Name: "billing.notify", Topic: "invoice.issued",
		Handler: handlers.Typed(func(ctx context.Context, e *invoiceIssued) error {
			var err error
			key, err = handlers.IdempotencyKey(ctx)
			if e.Customer == "eve" {
				return errors.New("eve is blocked")
			}
			return err
		}),
		Middleware: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) { wrapped.Store(true); return h(m) }
		}},
	}
	ok, err := pipeline.NewEvent(context.Background(), "inv-1", invoiceIssued{InvoiceID: 1, Customer: "bob"})
	require.NoError(t, err)
	require.NoError(t, ferrytest.RunRoute(t, route, ok, ferrytest.RunConfig{}))
	require.Equal(t, "ferry-billing.notify-"+ok.UUID, key, "the handler runs under its route's name")
	require.True(t, wrapped.Load(), "the route's own middleware ran")

	bad, err := pipeline.NewEvent(context.Background(), "inv-2", invoiceIssued{InvoiceID: 2, Customer: "eve"})
	require.NoError(t, err)
	require.ErrorContains(t, ferrytest.RunRoute(t, route, bad, ferrytest.RunConfig{}), "eve is blocked")

	malformed := message.NewMessage("m-3", []byte("not json"))
	err = ferrytest.RunRoute(t, route, malformed, ferrytest.RunConfig{})
	require.Error(t, err)
	require.True(t, pipeline.IsPermanent(err), "a payload that does not decode is permanent: %v", err)
}

func TestRunRouteWithTheLedgerRunsAnEffectOnce(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	var runs atomic.Int32
	route := handlers.Route{
		Name: "billing.record", Topic: "invoice.issued",
		Handler: handlers.Typed(func(ctx context.Context, e *invoiceIssued) error {
			runs.Add(1)
			_, err := pgledger.TxFromContext(ctx).Exec(ctx, `CREATE TABLE IF NOT EXISTS seen (id int)`)
			return err
		}),
	}
	msg, err := pipeline.NewEvent(context.Background(), "inv-1", invoiceIssued{InvoiceID: 1, Customer: "bob"})
	require.NoError(t, err)
	for range 2 {
		require.NoError(t, ferrytest.RunRoute(t, route, msg.Copy(), ferrytest.RunConfig{Ledger: ledger}))
	}
	require.Equal(t, int32(1), runs.Load(), "the second delivery is a duplicate")
	left, err := ledger.Unprocessed(context.Background(), route.Name, []string{msg.UUID, "other"})
	require.NoError(t, err)
	require.Equal(t, []string{"other"}, left, "the ledger holds the one delivery it ran")
}

// RequireHandled waits for every sent event to be in its handler's ledger
// or poison store, and says what is missing when one is in neither.
func TestRequireHandledWantsTheLedgerOrThePoisonStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	tbl := pipelinetest.OutboxTable(t)
	pipelinetest.InsertOutbox(t, pool, tbl,
		pipelinetest.OutboxRow{MessageUUID: "m-1", AggregateID: "a", Topic: "invoice.issued", Dispatched: true},
		pipelinetest.OutboxRow{MessageUUID: "m-2", AggregateID: "a", Topic: "invoice.issued", Dispatched: true},
		// Another topic's event, which this handler does not owe.
		pipelinetest.OutboxRow{MessageUUID: "m-3", AggregateID: "a", Topic: "other.topic", Dispatched: true})
	routes := []handlers.Route{{Name: "billing.record", Topic: "invoice.issued"}}
	requireHandled := func() string {
		rec := &fatalRecorder{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			ferrytest.RequireHandled(rec, pool, routes, 300*time.Millisecond)
		}()
		<-done
		return rec.msg
	}
	require.Contains(t, requireHandled(), "billing.record: 2 event(s) on invoice.issued not handled")

	ledger, err := pgledger.New(pool, pgledger.Config{}, nil)
	require.NoError(t, err)
	_, err = ledger.Once(ctx, "billing.record", "m-1", nil, func(context.Context) error { return nil })
	require.NoError(t, err)
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: "m-2", Topic: "invoice.issued", Handler: "other.handler"})
	require.Contains(t, requireHandled(), "billing.record: 1 event(s) on invoice.issued not handled", "another handler's poisoning is not this one's")

	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: "m-2", Topic: "invoice.issued", Handler: "billing.record"})
	require.Empty(t, requireHandled())
}

// fatalRecorder keeps what a helper's Fatalf says and ends the helper's
// goroutine as testing.T does.
type fatalRecorder struct {
	testing.TB
	msg  string
	logs []string
}

func (f *fatalRecorder) Helper() {}

func (f *fatalRecorder) Fatalf(format string, a ...any) {
	f.msg = fmt.Sprintf(format, a...)
	runtime.Goexit()
}

func (f *fatalRecorder) Logf(format string, a ...any) {
	f.logs = append(f.logs, fmt.Sprintf(format, a...))
}

// A pool whose search_path lacks Ferry's schema gets an error that says
// so, not a bare "relation does not exist"; an empty database says it
// checked nothing.
func TestRequireStoredEventsDecodeSaysWhatItChecked(t *testing.T) {
	schema := ferrytest.Schema(t)
	run := func(pool *pgxpool.Pool) *fatalRecorder {
		rec := &fatalRecorder{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			ferrytest.RequireStoredEventsDecode(rec, pool, testTable(t))
		}()
		<-done
		return rec
	}
	elsewhere := ferrytest.Pool(t, "public", "ferry-test-elsewhere")
	rec := run(elsewhere)
	require.Contains(t, rec.msg, "search_path")
	require.Contains(t, rec.msg, "pgdb.Config.Schema")

	rec = run(ferrytest.Pool(t, schema, "ferry-test-versions"))
	require.Empty(t, rec.msg)
	require.Contains(t, strings.Join(rec.logs, "\n"), "nothing checked")
}

func testTable(t *testing.T) pgoutbox.Table {
	tbl, err := ferrytest.OutboxTable()
	require.NoError(t, err)
	return tbl
}

// AppOn runs a release on a schema and namespace the test keeps: an event
// release 1 stored (it consumed another topic) is handled by release 2,
// and stop ends release 1 first.
func TestAppOnRunsReleasesOnOneSchema(t *testing.T) {
	ctx := context.Background()
	schema, rmq := ferrytest.Schema(t), ferrytest.Rabbit(t)
	routes := func(topic string, handled *atomic.Int64) func(app.Deps) ([]handlers.Route, error) {
		return func(app.Deps) ([]handlers.Route, error) {
			return []handlers.Route{{Name: "release." + topic, Topic: topic, Handler: func(*message.Message) error {
				handled.Add(1)
				return nil
			}}}, nil
		}
	}
	var first, second atomic.Int64
	a1, stop1 := ferrytest.AppOn(t, schema, rmq, app.Options{Routes: routes("release.other", &first)})
	msg, err := pipeline.NewEvent(ctx, "r-1", map[string]int{"release": 1})
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, a1.Pool(), func(tx pgx.Tx) error {
		return a1.Outbox().PublishTx(ctx, pgoutbox.PgxTx(tx), "release.one", msg)
	}))
	stop1()
	require.Error(t, a1.Pool().Ping(ctx), "stop closed release 1")

	a2, _ := ferrytest.AppOn(t, schema, rmq, app.Options{Routes: routes("release.one", &second)})
	require.Eventually(t, func() bool { return second.Load() == 1 }, 30*time.Second, 20*time.Millisecond, "release 2 handles release 1's event")
	rows, err := a2.OutboxTable().Rows(ctx, a2.Pool(), pgoutbox.RowFilter{MessageID: msg.UUID})
	require.NoError(t, err)
	require.Len(t, rows, 1)
	require.Zero(t, first.Load())
}

// Redeliver reaches an ordered route's partition: the copy goes through
// the relay's publisher, which routes by aggregate (the plain publisher
// sent it to no queue, and the test timed out blaming the handler).
func TestRedeliverReachesAnOrderedRoute(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var runs atomic.Int64
	a := ferrytest.App(t, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "ledger.post", Topic: "ledger.entry", Ordered: true, Handler: func(*message.Message) error {
			runs.Add(1)
			return nil
		}}}, nil
	}})
	msg, err := pipeline.NewEvent(ctx, "account-1", map[string]int{"amount": 5})
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, a.Pool(), func(tx pgx.Tx) error {
		return a.Outbox().PublishTx(ctx, pgoutbox.PgxTx(tx), "ledger.entry", msg)
	}))
	ferrytest.RequireHandled(t, a.Pool(), a.Routes(), 30*time.Second)
	ferrytest.Redeliver(t, a, msg.UUID, 30*time.Second)
	require.EqualValues(t, 1, runs.Load(), "the copy was a duplicate")
}
