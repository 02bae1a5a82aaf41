// Package snippets holds the Go code the documentation shows, as code the
// compiler checks: each "// snippet:begin NAME" region is what a docs page
// shows under "<!-- snippet: examples/snippets/snippets.go#NAME -->", and
// TestDocSnippets fails when the two differ. The functions are not meant
// to be called; they give every name a snippet uses a definition.
package snippets

import (
	"context"
	"database/sql"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgbudget"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// InvoiceIssued is the event the snippets publish.
type InvoiceIssued struct {
	InvoiceID string `json:"invoice_id"`
	Customer  string `json:"customer"`
}

// UserSignedUp is the event the route table snippet consumes.
type UserSignedUp struct {
	UserID string `json:"user_id"`
}

// snippet:begin publish-tx
// IssueInvoice writes the invoice and its event in one database/sql
// transaction: both commit, or neither.
func IssueInvoice(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger, invoiceID, customer string) error {
	db := pgdb.SQLDB(pool) // database/sql over your pgxpool
	outbox, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO invoices (id, customer) VALUES ($1, $2)`, invoiceID, customer); err != nil {
		return err
	}
	evt, err := pipeline.NewEvent(ctx, invoiceID, InvoiceIssued{InvoiceID: invoiceID, Customer: customer}) // copies correlation/trace ids from ctx
	if err != nil {
		return err
	}
	pipeline.WithDelay(evt, 3*time.Minute) // optional: "send the welcome mail in 3 minutes"
	if err := outbox.PublishTx(ctx, tx, "invoice.issued", evt); err != nil {
		return err
	}
	return tx.Commit() // the relays' probe finds the event once due; nothing to call after the commit
}

// snippet:end publish-tx

// snippet:begin publish
// Issue is IssueInvoice on a pgx transaction, in the fewest lines:
// Publish is pipeline.NewEvent and PublishTx in one call.
func Issue(ctx context.Context, pool *pgxpool.Pool, outbox *pgoutbox.Outbox, invoiceID, customer string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO invoices (id, customer) VALUES ($1, $2)`, invoiceID, customer); err != nil {
			return err
		}
		return outbox.Publish(ctx, tx, "invoice.issued", invoiceID, InvoiceIssued{InvoiceID: invoiceID, Customer: customer})
	})
}

// snippet:end publish

// snippet:begin watched-pool
// OpenWatchedPool opens a pool of the service's own whose commits of
// events wake the relays at the commit, however the code commits.
func OpenWatchedPool(ctx context.Context, url string, outbox *pgoutbox.Outbox) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	watch := pgoutbox.NewCommitWatch()
	watch.OnCommit(outbox.Committed) // the app's outbox: its Waker tells every relay
	watch.Watch(cfg)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// snippet:end watched-pool

// snippet:begin follow-up
// MarkMailed runs inside a handler: its event commits with the handler's
// ledger row, or not at all.
func MarkMailed(ctx context.Context, outbox *pgoutbox.Outbox, next *message.Message) error {
	return outbox.PublishTx(ctx, pgoutbox.PgxTx(pgledger.TxFromContext(ctx)), "invoice.mailed", next)
}

// snippet:end follow-up

// snippet:begin in-tx
// IssueInTx is IssueInvoice where Ferry owns the transaction: BEGIN rides
// on the first statement, the events and the queued update on the COMMIT.
func IssueInTx(ctx context.Context, pool *pgxpool.Pool, outbox *pgoutbox.Outbox, customerID int64, evt *message.Message) error {
	return outbox.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
		var id int64
		if err := q.QueryRow(ctx, `INSERT INTO invoices (customer_id) VALUES ($1) RETURNING id`, customerID).Scan(&id); err != nil {
			return err
		}
		p.Queue(`UPDATE customers SET invoiced_at = now() WHERE id = $1`, customerID) // optional: rides on the COMMIT too
		return p.PublishEvents(ctx, pipeline.Outgoing{Topic: "invoice.issued", Msg: evt})
	})
}

// snippet:end in-tx

// CRM is the external system the route table snippet syncs to.
type CRM interface {
	Upsert(ctx context.Context, e *UserSignedUp, idempotencyKey string) error
}

// snippet:begin app
// Run builds the app from the route table, a link of your own, your
// migrations and your HTTP API, and runs every component.
func Run(ctx context.Context, crm CRM, audit message.HandlerMiddleware, myTables migrations.Set, api http.Handler) error {
	cfg, err := app.ConfigFromEnv() // FERRY_* variables, validated
	if err != nil {
		return err
	}
	opts := app.Options{
		Routes: func(d app.Deps) ([]handlers.Route, error) {
			return []handlers.Route{{
				Name:  "crm.sync-signup", // stable: names its queue and its ledger key
				Topic: "user.signed_up",
				Handler: handlers.Typed(func(ctx context.Context, e *UserSignedUp) error {
					key, err := handlers.IdempotencyKey(ctx) // send it with the external call
					if err != nil {
						return err
					}
					return crm.Upsert(ctx, e, key)
				}),
			}}, nil
		},
		Chain: func(c middleware.Chain) (middleware.Chain, error) { // your link, at a chosen place
			return c.InsertAfter(middleware.LinkCorrelation, middleware.Link{Name: "audit", Middleware: audit})
		},
		Migrations: []migrations.Set{myTables},                               // your own goose files, own version table
		HTTP:       func(*app.App) (http.Handler, error) { return api, nil }, // optional: served on FERRY_HTTP_ADDR
	}
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		return err
	}
	defer a.Close()
	return a.Run(ctx, app.All, nil)
}

// snippet:end app

// snippet:begin mount
// MountOn adds Ferry's consumers to the Watermill router you already run.
func MountOn(ctx context.Context, a *app.App, router *message.Router) error {
	consumers, err := a.Mount(router) // Ferry's chain per handler, partition queues, topology
	if err != nil {
		return err
	}
	defer consumers.Close() // after the router has stopped
	return router.Run(ctx)
}

// snippet:end mount

// snippet:begin budget
// WithBudget defers a route's messages once 10,000 cost units a day are
// spent, instead of failing them.
func WithBudget(pool *pgxpool.Pool, route handlers.Route, logger *slog.Logger) (handlers.Route, error) {
	spender, err := pgbudget.New(pool)
	if err != nil {
		return route, err
	}
	llm, err := middleware.NewBudget(middleware.BudgetConfig{
		Name: "openai", Limit: 10_000, Window: 24 * time.Hour, // cost units per UTC day
		Cost:    func(m *message.Message) int64 { return 1 }, // or the request's token estimate
		Spender: spender,
	}, logger)
	if err != nil {
		return route, err
	}
	route.Middleware = append(route.Middleware, llm.Middleware)
	return route, nil
}

// snippet:end budget

// snippet:begin cdc
// RunCDC streams the outbox from the WAL, with the polling relay as the
// safety net, without the app. ordered are the topics kept in order per
// aggregate (rabbit.Topology.OrderedTopics).
func RunCDC(ctx context.Context, pool *pgxpool.Pool, pub message.Publisher, ordered []string, logger *slog.Logger) error {
	// The safety net: the polling relay, slow and out of the stream's way.
	relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{
		OrderedTopics: ordered,
		PollOnly:      true, PollInterval: pgcdc.DefaultSafetyNetInterval, MinAge: pgcdc.DefaultSafetyNetMinAge,
	}, logger)
	if err != nil {
		return err
	}
	cdc, err := pgcdc.NewStreamer(pool, relay, pgoutbox.Table{}, pgcdc.Config{}, logger)
	if err != nil {
		return err
	}
	cdc.Wake = relay.Wake                    // a recreated slot: look for what it missed now
	if err := cdc.Prepare(ctx); err != nil { // wal_level, version, publication, slot
		return err
	}
	go func() { _ = relay.Run(ctx) }()
	return cdc.Run(ctx)
}

// snippet:end cdc

// LegacyMailer is the code a service ran before Ferry.
type LegacyMailer interface {
	Send(ctx context.Context, orderID string) error
}

// snippet:begin cutoff
// MailOrder sends an order's mail through the outbox when the order is
// past the topic's cut-off, and the old way before it.
func MailOrder(ctx context.Context, a *app.App, tx *sql.Tx, legacy LegacyMailer, orderID string, createdAt time.Time, evt *message.Message) error {
	// App.Cutoff is built from FERRY_CUTOFF / FERRY_CUTOFF_TOPICS; cutoff.New does it in code.
	if a.Cutoff().Outboxed(ctx, "mail.send", orderID, createdAt) {
		return a.Outbox().PublishTx(ctx, tx, "mail.send", evt) // the new path, in the business transaction
	}
	return legacy.Send(ctx, orderID) // the old path, as before
}

// snippet:end cutoff

// snippet:begin shadow
// MailOrderShadowed keeps the legacy send and records, in the same
// transaction, both it and the intent the outbox would send.
func MailOrderShadowed(ctx context.Context, outbox *pgoutbox.Outbox, tx *sql.Tx, legacy LegacyMailer, orderID string, evt *message.Message) error {
	if err := legacy.Send(ctx, orderID); err != nil {
		return err
	}
	if err := shadow.RecordLegacy(ctx, tx, "mail.send", orderID); err != nil { // beside the legacy send
		return err
	}
	return outbox.PublishTx(ctx, tx, "mail.send", pipeline.WithShadow(evt)) // the intent, marked shadow_mode: true
}

// snippet:end shadow

// snippet:begin batch-route
// InvoiceTotals keeps a read model, invoices per customer, with a batch
// route: one transaction per batch of up to 200 events holds their ledger
// rows and one upsert per customer, sent in one round trip.
func InvoiceTotals() handlers.Route {
	return handlers.Route{
		Name:  "reports.invoice-totals",
		Topic: "invoice.issued",
		Batch: &handlers.Batch{
			MaxSize: 200,
			Handler: func(ctx context.Context, msgs []*message.Message) error {
				counts := map[string]int{}
				for _, m := range msgs {
					e, err := handlers.Decode[InvoiceIssued](m)
					if err != nil {
						// Permanent: fails this batch; alone, this event is
						// poisoned with the reason, the others go through.
						return err
					}
					counts[e.Customer]++
				}
				// Rows in a stable order: two batches in flight never
				// wait on each other's rows in opposite orders.
				b := &pgx.Batch{}
				for _, customer := range slices.Sorted(maps.Keys(counts)) {
					b.Queue(`INSERT INTO invoice_totals (customer, invoices) VALUES ($1, $2)
						ON CONFLICT (customer) DO UPDATE SET invoices = invoice_totals.invoices + $2`, customer, counts[customer])
				}
				return pgledger.TxFromContext(ctx).SendBatch(ctx, b).Close()
			},
		},
	}
}

// snippet:end batch-route
