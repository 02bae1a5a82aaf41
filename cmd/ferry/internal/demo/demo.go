package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/wait"
	"github.com/ferry-dev/ferry/pipeline"

	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/examples/orders/ordersapp"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Demo defaults: a schema and namespace of its own, so it never touches an
// application's data.
const (
	DemoSchema    = "ferry_demo"
	DemoNamespace = "ferry_demo."
	DemoTimeout   = 60 * time.Second
)

// DemoReport is what the demo observed.
type DemoReport struct {
	Schema, Namespace   string
	Orders              int
	OrderReplaysDeduped int
	EventsRelayed       int64
	Redeliveries        int
	ChargeRequests      int
	Charges             int
	Mails               int
	LedgerDuplicates    int64
	Elapsed             time.Duration
}

// Demo runs the whole pipeline once against the local servers: it migrates
// a fresh schema, starts the relay and the consumers with an in-process
// payment provider and SMTP sink, places sample orders (one twice with the
// same idempotency key), simulates a relay crash that redelivers one event,
// waits until every side effect has happened and checks that each happened
// exactly once. The summary goes to out.
func Demo(ctx context.Context, cfg app.Config, out io.Writer, logger *slog.Logger) (rep DemoReport, err error) {
	start := time.Now()
	if cfg.DatabaseSchema == "" {
		cfg.DatabaseSchema = DemoSchema
	}
	if cfg.AMQP.Namespace == "" {
		cfg.AMQP.Namespace = DemoNamespace
	}
	if cfg.Relay.PollInterval == 0 {
		cfg.Relay.PollInterval = 50 * time.Millisecond
	}
	if cfg.AdminAddr == "" {
		cfg.AdminAddr = "off" // a one-shot run: nobody scrapes it, and it must not clash with a running ferry
	}
	rep.Schema, rep.Namespace = cfg.DatabaseSchema, cfg.AMQP.Namespace
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}

	world, err := sandbox.StartWorld()
	if err != nil {
		return rep, err
	}
	defer world.Close()
	provider, sink := world.Payments, world.SMTP
	ex := ordersapp.Config{PaymentURL: provider.URL(), SMTPAddr: sink.Addr()}.WithDefaults()

	ctx, cancel := context.WithTimeout(ctx, DemoTimeout)
	defer cancel()

	// A fresh schema every run: drop what an earlier demo left.
	admin, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.WithDefaults().DatabaseURL, ApplicationName: "ferry-demo"})
	if err != nil {
		return rep, err
	}
	err = pgdb.DropSchema(ctx, admin, cfg.DatabaseSchema)
	admin.Close()
	if err != nil {
		return rep, err
	}

	opts := ordersapp.Options(ex)
	opts.Migrate, opts.Logger = true, logger
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		return rep, err
	}
	defer a.Close()
	svc, err := ordersapp.NewService(a)
	if err != nil {
		return rep, err
	}
	// The schema stays for inspection; the queues, empty by then, go.
	defer func() {
		if terr := a.Topology().Teardown(a.Broker()); terr != nil && err == nil {
			err = fmt.Errorf("removing demo topology: %w", terr)
		}
	}()
	// Messages an interrupted earlier demo left in its queues would refer
	// to outbox rows of the dropped schema.
	if err := a.Topology().Purge(a.Broker()); err != nil {
		return rep, err
	}

	stop, err := a.Start(ctx, app.Components{Relay: true, Consumers: true})
	if err != nil {
		return rep, fmt.Errorf("starting pipeline: %w", err)
	}
	defer stop()

	inputs := []orders.Input{
		{UserID: "alice", Amount: 1200, Currency: orders.CurrencyJPY, IdempotencyKey: "demo-order-1"},
		{UserID: "bob", Amount: 1999, Currency: orders.CurrencyUSD, IdempotencyKey: "demo-order-2"},
		{UserID: "carol", Amount: 5400, Currency: orders.CurrencyJPY, IdempotencyKey: "demo-order-3"},
		// The same request again, as a client retrying after a timeout would send it.
		{UserID: "alice", Amount: 1200, Currency: orders.CurrencyJPY, IdempotencyKey: "demo-order-1"},
	}
	for _, in := range inputs {
		res, err := svc.CreateOrder(ctx, in)
		if err != nil {
			return rep, fmt.Errorf("create_order %s: %w", in.IdempotencyKey, err)
		}
		if res.Deduped {
			rep.OrderReplaysDeduped++
		} else {
			rep.Orders++
		}
	}
	effects := func() bool { return len(provider.Charges()) >= rep.Orders && len(sink.Mails()) >= rep.Orders }
	if err := wait.For(ctx, effects); err != nil {
		return rep, fmt.Errorf("waiting for side effects: %d of %d charges, %d of %d mails: %w",
			len(provider.Charges()), rep.Orders, len(sink.Mails()), rep.Orders, err)
	}

	// Simulate a relay that crashed after the broker confirmed the first
	// charge event but before its position moved past the row: the relay
	// sends it again, and the consumers' ledger must acknowledge it
	// without charging twice.
	if err := sendAgain(ctx, a, orders.TopicChargeRequested); err != nil {
		return rep, fmt.Errorf("simulating relay crash: %w", err)
	}
	rep.Redeliveries = 1
	if err := wait.For(ctx, func() bool { return a.Stats().Duplicates >= 1 }); err != nil {
		return rep, fmt.Errorf("waiting for the redelivered event: %w", err)
	}
	// A moment for any effect that should not happen to show itself.
	time.Sleep(200 * time.Millisecond)
	if err := stop(); err != nil {
		return rep, fmt.Errorf("pipeline: %w", err)
	}

	// The copy sent for the simulated crash stands for the relay's second
	// send.
	rep.EventsRelayed = a.Stats().Relay.Dispatched + int64(rep.Redeliveries)
	rep.ChargeRequests = provider.Requests()
	rep.Charges = len(provider.Charges())
	rep.Mails = len(sink.Mails())
	rep.LedgerDuplicates = a.Stats().Duplicates
	rep.Elapsed = time.Since(start)
	printDemoReport(out, rep)
	return rep, rep.check()
}

// check holds the demo's promise: one charge and one mail per order.
func (r DemoReport) check() error {
	var errs []error
	if r.Charges != r.Orders || r.ChargeRequests != r.Orders {
		errs = append(errs, fmt.Errorf("%d orders but %d charges from %d provider requests", r.Orders, r.Charges, r.ChargeRequests))
	}
	if r.Mails != r.Orders {
		errs = append(errs, fmt.Errorf("%d orders but %d mails", r.Orders, r.Mails))
	}
	if r.LedgerDuplicates != int64(r.Redeliveries) {
		errs = append(errs, fmt.Errorf("%d redelivery but %d duplicates suppressed", r.Redeliveries, r.LedgerDuplicates))
	}
	return errors.Join(errs...)
}

func printDemoReport(w io.Writer, r DemoReport) {
	var b strings.Builder
	fmt.Fprintf(&b, "Ferry demo (schema %s, RabbitMQ namespace %s)\n", r.Schema, r.Namespace)
	fmt.Fprintf(&b, "  orders placed          %3d   (+%d repeated request answered deduped: true)\n", r.Orders, r.OrderReplaysDeduped)
	fmt.Fprintf(&b, "  events relayed         %3d   (%d events + %d redelivery after a simulated relay crash)\n", r.EventsRelayed, 2*r.Orders, r.Redeliveries)
	fmt.Fprintf(&b, "  charges made           %3d   (payment provider saw %d requests)\n", r.Charges, r.ChargeRequests)
	fmt.Fprintf(&b, "  mails sent             %3d\n", r.Mails)
	fmt.Fprintf(&b, "  duplicates suppressed  %3d   (%d create_order replay, %d consumer redelivery)\n",
		int64(r.OrderReplaysDeduped)+r.LedgerDuplicates, r.OrderReplaysDeduped, r.LedgerDuplicates)
	fmt.Fprintf(&b, "  took                   %s\n", r.Elapsed.Round(time.Millisecond))
	if err := r.check(); err != nil {
		fmt.Fprintf(&b, "FAILED: %v\n", err)
	} else {
		b.WriteString("ok: every side effect happened exactly once\n")
	}
	_, _ = io.WriteString(w, b.String())
}

// sendAgain publishes the first event of topic once more, as the relay
// does when it crashed between the broker's confirm and the position's
// move.
func sendAgain(ctx context.Context, a *app.App, topic string) error {
	rows, err := a.OutboxTable().Rows(ctx, a.Pool(), pgoutbox.RowFilter{Topic: topic})
	if err != nil {
		return err
	}
	if len(rows) == 0 {
		return fmt.Errorf("no %s event in the outbox", topic)
	}
	first := rows[0]
	msg := message.NewMessage(first.MessageID, first.Payload)
	for k, v := range first.Headers {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(pipeline.MetaAggregateID, first.AggregateID)
	// The relay's publisher: it routes an ordered topic's message to its
	// aggregate's partition (a.Publisher does not).
	return a.BatchPublisher().Publish(topic, msg)
}
