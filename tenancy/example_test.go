package tenancy_test

import (
	"context"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// A tenant's service publishes into its own database's outbox as any
// service does; its pool's commits wake the fleet's relay, which listens
// on that database.
func Example_producer() {
	ctx := context.Background()
	// snippet:begin producer
	commits := pgoutbox.NewCommitWatch()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: os.Getenv("ACME_DATABASE_URL"), Configure: commits.Watch})
	if err != nil {
		log.Fatal(err)
	}
	outbox, err := pgoutbox.New(pgoutbox.Config{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	// After each commit of events, one NOTIFY on the tenant's database:
	// the fleet's listener there wakes the tenant's relay.
	waker := pgoutbox.NewWaker(pool, pgoutbox.WakerConfig{})
	outbox.SetWaker(waker)
	commits.OnCommit(waker.Committed)
	go waker.Run(ctx)

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, $2)`, "o-1", 4200); err != nil {
			return err
		}
		// tenant_id travels in the headers; the fleet's relay sets it to
		// the tenant whose outbox the event is in, whatever it said.
		return outbox.Publish(pipeline.ContextWithTenantID(ctx, "acme"), tx, "orders.placed", "o-1", map[string]any{"id": "o-1"})
	})
	// snippet:end producer
	if err != nil {
		log.Fatal(err)
	}
}

// A route of a tenant fleet writes through the ledger's transaction: it
// is on the event's tenant's database.
func Example_handler() {
	// snippet:begin handler
	routes := func(d app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "ship", Topic: "orders.placed", Handler: func(msg *message.Message) error {
			ctx := msg.Context()
			tx := pgledger.TxFromContext(ctx) // on the tenant's database
			if _, err := tx.Exec(ctx, `INSERT INTO shipments (order_id) VALUES ($1)`, msg.Metadata.Get(pipeline.MetaAggregateID)); err != nil {
				return err
			}
			// A follow-up event, into the same tenant's outbox, in the
			// same transaction: d.Outbox names no schema in a fleet.
			return d.Outbox.Publish(ctx, tx, "orders.shipped", msg.Metadata.Get(pipeline.MetaAggregateID), map[string]string{"tenant": pipeline.TenantIDFromContext(ctx)})
		}}}, nil
	}
	// snippet:end handler
	_ = routes
}
