// Package invoices is a small service built on Ferry's public API only, as
// a team would write it: its own table (migrations/), an invoice.issued
// event written in the same transaction as the invoice, a handler that
// marks the invoice sent and publishes invoice.sent in its ledger
// transaction, and a middleware link of its own (every event must name its
// tenant). cmd/invoices is its binary, with Ferry's operations commands.
package invoices

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Topics and the route of the service.
const (
	TopicIssued   = "invoice.issued"
	TopicSent     = "invoice.sent"
	RouteMarkSent = "invoices.mark-sent"
)

// snippet:begin migrations

//go:embed migrations/*.sql
var files embed.FS

// Migrations is the service's own migration set, beside Ferry's.
var Migrations = migrations.Set{Name: "invoices", FS: must(fs.Sub(files, "migrations")), VersionTable: "invoices_schema_version"}

// snippet:end migrations

func must(f fs.FS, err error) fs.FS {
	if err != nil {
		panic(err) // the embedded directory is part of the binary
	}
	return f
}

// Issued is the invoice.issued event.
type Issued struct {
	InvoiceID   int64  `json:"invoice_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// Validate is called by handlers.Typed before the handler runs.
func (e Issued) Validate() error {
	if e.InvoiceID <= 0 || e.Customer == "" || e.AmountCents <= 0 {
		return errors.New("invoice_id, customer and a positive amount_cents are required")
	}
	return nil
}

// snippet:begin issue
// Issue writes an invoice and its invoice.issued event in one transaction.
func Issue(ctx context.Context, pool *pgxpool.Pool, outbox *pgoutbox.Outbox, tenant, customer string, amountCents int64) (id int64, err error) {
	ctx = pipeline.ContextWithTenantID(ctx, tenant)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `INSERT INTO invoices (tenant_id, customer, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			tenant, customer, amountCents).Scan(&id); err != nil {
			return fmt.Errorf("inserting invoice: %w", err)
		}
		return outbox.Publish(ctx, tx, TopicIssued, strconv.FormatInt(id, 10), Issued{InvoiceID: id, Customer: customer, AmountCents: amountCents})
	})
	return id, err
}

// snippet:end issue

// RequireTenant is the service's own middleware link: an event without a
// tenant cannot be attributed, so it is poisoned at once with the reason;
// the tenant goes into the context for the events the handler publishes.
func RequireTenant(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		tenant := msg.Metadata.Get(pipeline.MetaTenantID)
		if tenant == "" {
			return nil, pipeline.Permanent(fmt.Errorf("event has no %s", pipeline.MetaTenantID))
		}
		msg.SetContext(pipeline.ContextWithTenantID(msg.Context(), tenant))
		return h(msg)
	}
}

// snippet:begin routes
// Routes is the service's route table.
func Routes(d app.Deps) ([]handlers.Route, error) {
	return []handlers.Route{{
		Name:  RouteMarkSent,
		Topic: TopicIssued,
		Handler: handlers.Typed(func(ctx context.Context, e *Issued) error {
			// The ledger's transaction: the update and the follow-up event
			// commit with the "processed" mark, or not at all.
			tx := pgledger.TxFromContext(ctx)
			if _, err := tx.Exec(ctx, `UPDATE invoices SET sent_at = now() WHERE id = $1`, e.InvoiceID); err != nil {
				return err
			}
			return d.Outbox.Publish(ctx, tx, TopicSent, strconv.FormatInt(e.InvoiceID, 10), map[string]int64{"invoice_id": e.InvoiceID})
		}),
	}}, nil
}

// Options are the service's app options: routes, its link, its migrations.
func Options() app.Options {
	return app.Options{
		Routes:     Routes,
		Migrations: []migrations.Set{Migrations},
		// Innermost, inside the ledger transaction: a Permanent error there
		// skips the retries and goes to the poison store with its reason.
		Chain: func(c middleware.Chain) (middleware.Chain, error) {
			return c.Append(middleware.Link{Name: "require-tenant", Middleware: RequireTenant})
		},
	}
}

// snippet:end routes
