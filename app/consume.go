package app

import (
	"context"
	"errors"
	"fmt"
	"io"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// NewRouter builds Ferry's own consumer router: Watermill's router metrics
// router-wide, and the route table mounted on it (see Mount). The returned
// closer releases the consumers' connection once the router has stopped.
func (a *App) NewRouter() (*message.Router, io.Closer, error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: a.cfg.ShutdownTimeout}, a.watermillLogger())
	if err != nil {
		return nil, nil, err
	}
	// Watermill's own router metrics (handler execution time, publish and
	// subscribe counts) go to the same registry; added first, so outermost.
	wmetrics.NewPrometheusMetricsBuilder(a.metrics.Registry, "", "").AddPrometheusRouterMetrics(router)
	conn, err := a.Mount(router)
	if err != nil {
		return nil, nil, err
	}
	return router, conn, nil
}

// Chain is the middleware chain every route runs in: the default chain
// wired to this app's ledger, poison store, retries, metrics and tracing,
// as edited by Options.Chain.
func (a *App) Chain() (middleware.Chain, error) {
	durable := a.cfg.DurableRetry
	durable.Scheduler = a.rescheduler
	if a.ledgers != nil {
		durable.Scheduler = a.ledgers // into the outbox of the event's tenant
	}
	if durable.Holds == nil {
		durable.Holds = pgheld.Store{Pool: a.pool}
	}
	chain, err := middleware.DefaultChain(middleware.ChainConfig{
		Poison:         middleware.PoisonConfig{Publisher: a.poisonPublisher},
		DurableRetry:   durable,
		Retry:          a.cfg.Retry,
		Idempotency:    a.idempotency,
		Logger:         a.logger,
		Recorder:       a.metrics,
		Tracing:        a.tracer.Consumer,
		TracingAttempt: a.tracer.Attempt,
		Pause:          middleware.PauseConfig{Watch: a.pauses},
	})
	if err != nil {
		return nil, err
	}
	if a.parking != nil {
		// Right inside the infrastructure link, which waits out its read
		// of the control database; outside the ledger, whose deferral of
		// a tenant out of reach it turns into a parked event.
		if chain, err = chain.InsertAfter(middleware.LinkInfra, middleware.Link{Name: middleware.LinkPark, Middleware: a.parking.Middleware}); err != nil {
			return nil, err
		}
	}
	if a.opts.Chain != nil {
		if chain, err = a.opts.Chain(chain); err != nil {
			return nil, fmt.Errorf("editing middleware chain: %w", err)
		}
	}
	return chain, nil
}

// Mount adds the route table to router, a Watermill router of the caller's
// (with middleware and handlers of its own) or Ferry's: every route gets
// Ferry's chain (Chain) and its own middleware, and consumes its queue, or
// one queue per partition for an ordered topic, as the topology says. Mount
// adds nothing router-wide.
//
// The consumers share one broker connection; close it after the router has
// stopped.
func (a *App) Mount(router *message.Router) (io.Closer, error) {
	if router == nil {
		return nil, errors.New("app: Mount needs a router")
	}
	if a.opts.WithoutBroker {
		return nil, errors.New("app: an app built WithoutBroker has no consumers to mount")
	}
	chain, err := a.Chain()
	if err != nil {
		return nil, err
	}
	mws := chain.Middlewares()
	// The consumers ask the pause watch before they attach: one read now,
	// so that they attach at once rather than one after another behind it.
	a.pauses.Paused(context.Background(), "")
	// New declared the topology already (an app WithoutBroker has no
	// consumers to mount), and each subscriber declares its own queue.
	conn, err := rabbit.Dial(a.cfg.AMQP, "ferry-consumer", a.watermillLogger())
	if err != nil {
		return nil, err
	}
	for _, r := range a.routes {
		if r.Batch != nil {
			if err := a.mountBatch(router, conn, chain, r); err != nil {
				conn.Close()
				return nil, err
			}
			continue
		}
		// An ordered route consumes one queue per partition, each its own
		// router handler ("<route>@<k>"), so order holds per partition; a
		// tenant fleet's route its backlog lane too ("<route>@b<k>").
		for _, s := range a.subscriptions(r) {
			sub, err := a.consumer(conn, s, 1)
			if err != nil {
				conn.Close()
				return nil, fmt.Errorf("subscribing %s to %s: %w", s.Name, r.Topic, err)
			}
			h := router.AddConsumerHandler(s.Name, r.Topic, sub, r.Handler)
			h.AddMiddleware(mws...)
			h.AddMiddleware(r.Middleware...)
		}
	}
	return conn, nil
}

// DrainingLog is the INFO line of a consumer whose stop began with messages
// in its handlers: they finish (up to FERRY_SHUTDOWN_TIMEOUT) before it
// closes.
const DrainingLog = "stopping: the messages in handlers finish first"

// consumer is the consumer of one of a route's queues. A stop drains it
// for up to FERRY_SHUTDOWN_TIMEOUT (the router's own bound): a deploy
// lets handlers finish and settle what they hold, so none runs twice, and
// what is left goes back first in line (rabbit.ConsumerConfig). A pause
// of its route (ferry pause) detaches it, so that nothing waits unacked
// past the broker's consumer_timeout. A process that cannot reach its
// database steps aside the same way (rabbit.ConsumerConfig.StepAside).
func (a *App) consumer(conn *wamqp.ConnectionWrapper, s rabbit.Subscription, inFlight int) (*rabbit.Consumer, error) {
	route := pipeline.RouteName(s.Name)
	paused := func() bool { return a.pauses.Paused(context.Background(), route) }
	// A process whose database does not answer steps aside: its
	// deliveries (and ordered partitions) go to processes that can reach
	// theirs, within a poll, the read's bound and the grace.
	stepAside := func() bool { return a.pauses.Unreachable(context.Background()) != nil }
	draining := func(n int) {
		a.logger.Info(DrainingLog, "handler", s.Name, "in_handlers", n, "drain_timeout", a.cfg.ShutdownTimeout)
	}
	return rabbit.NewConsumer(conn, a.topology, s, rabbit.ConsumerConfig{
		InFlight: inFlight, DrainTimeout: a.cfg.ShutdownTimeout, Paused: paused, PausePoll: a.pauses.Poll(), Draining: draining, StepAside: stepAside,
	}, a.watermillLogger())
}

// validateBatches checks the batch routes against the topology: a topic
// ordered by another route or FERRY_ORDERED_TOPICS cannot be batched
// either, and the batching itself must be valid.
func validateBatches(routes []handlers.Route, topo *rabbit.Topology) error {
	var errs []error
	for _, r := range routes {
		if r.Batch == nil {
			continue
		}
		if topo.Ordered(r.Topic) {
			errs = append(errs, fmt.Errorf("route %q is batched but its topic %q is ordered (by another route or FERRY_ORDERED_TOPICS): a batch keeps no order", r.Name, r.Topic))
		}
		if err := batchConfig(r).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("route %q: %w", r.Name, err))
		}
	}
	return errors.Join(errs...)
}

func batchConfig(r handlers.Route) middleware.BatchConfig {
	return middleware.BatchConfig{MaxSize: r.Batch.MaxSize, MaxWait: r.Batch.MaxWait, MaxGap: r.Batch.MaxGap}
}

// subscriptions are the consumers route r runs: the topology's, or one for
// a batch route, which holds many deliveries on one channel instead of one
// each on FERRY_AMQP_CONSUMERS channels (measured: RabbitMQ spent 266–276
// µs per message at 1,000/s with one channel against 359–398 with eight:
// deliveries and acks share frames).
func (a *App) subscriptions(r handlers.Route) []rabbit.Subscription {
	if r.Batch != nil {
		subs := []rabbit.Subscription{a.topology.Subscription(r.Name)}
		if lane := a.topology.BacklogSubscriptions(r.Name, r.Topic); len(lane) > 0 {
			// A tenant fleet's backlog lane: one consumer of it holds
			// batches as the main queue's does.
			subs = append(subs, lane[0])
		}
		return subs
	}
	return append(a.topology.Subscriptions(r.Name, r.Topic), a.topology.BacklogSubscriptions(r.Name, r.Topic)...)
}

// mountBatch mounts a batch route: its consumer (rabbit.Consumer) holds
// two batches' worth of deliveries, acked many at a time, and one Batcher, shared by
// them, takes the place of the handler and of the chain's idempotency link.
func (a *App) mountBatch(router *message.Router, conn *wamqp.ConnectionWrapper, chain middleware.Chain, r handlers.Route) error {
	var ledger middleware.BatchLedger = a.ledger
	if a.ledgers != nil {
		// A tenant fleet: each batch on its tenant's database.
		ledger = a.ledgers
	}
	batcher, err := middleware.NewBatcher(a.idempotency, ledger, r.Batch.Handler, batchConfig(r))
	if err != nil {
		return fmt.Errorf("route %q: %w", r.Name, err)
	}
	mws := chain.Without(middleware.LinkIdempotency).Middlewares()
	// Twice a batch in hand: one batch fills while the one before commits;
	// more only costs memory.
	inFlight := 2 * batchConfig(r).WithDefaults().MaxSize
	for _, s := range a.subscriptions(r) {
		sub, err := a.consumer(conn, s, inFlight)
		if err != nil {
			return fmt.Errorf("subscribing %s to %s: %w", s.Name, r.Topic, err)
		}
		h := router.AddConsumerHandler(s.Name, r.Topic, sub, func(msg *message.Message) error {
			_, err := batcher.Handler(msg)
			return err
		})
		h.AddMiddleware(mws...)
		h.AddMiddleware(r.Middleware...)
	}
	return nil
}
