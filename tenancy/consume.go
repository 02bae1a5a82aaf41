package tenancy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
)

// ErrNoTenant is the reason an event without a tenant_id is poisoned by a
// tenant fleet's consumers: there is no database to handle it in.
var ErrNoTenant = errors.New("the event names no tenant (no tenant_id header): a tenant fleet handles an event only in its tenant's database")

// ErrUnknownTenant is the reason an event of a tenant the registry does
// not hold (removed, or never added) is poisoned.
var ErrUnknownTenant = errors.New("tenant is not in the registry (removed, or never added): its event is handled in no other tenant's database")

// Ledgers are the consumers' ledger and durable retries in a tenant fleet:
// each delivery runs in a transaction on its tenant's database (the
// tenant_id the relay stamped, in the message's context from the
// correlation link), so the handler's writes (pgledger.TxFromContext), its
// ledger row and its follow-up events commit together there, and a retry
// waits in its tenant's outbox. The route table does not change.
//
// An event of no tenant or of a tenant not registered is refused as
// Permanent (the poison store keeps it, with the reason). An event whose
// tenant's database is out of reach is deferred into the control
// database's outbox (no attempt spent), not waited out in the handler.
type Ledgers struct {
	fleet   *Fleet
	outbox  *pgoutbox.Outbox
	control *pgoutbox.Rescheduler
	ledger  pgledger.Config
	logger  *slog.Logger

	mu    sync.Mutex
	m     map[string]*tenantLedger
	slots map[string]chan struct{} // MaxHandlers per tenant, as last read
}

type tenantLedger struct {
	pool    *pgxpool.Pool
	ledger  *pgledger.Ledger
	retries *pgoutbox.Rescheduler
}

// TenantOutageDelay is how long an event whose tenant's database is out
// of reach waits, in the control database's outbox, before it is tried
// again (pipeline.Defer: no attempt spent).
const TenantOutageDelay = 10 * time.Second

// TenantOutageRecheck is how soon an event of an ordered partition whose
// tenant's database is out of reach is tried again when it could not be
// parked (Parking; the control database out of reach too). Such an event
// is not written back: its partition holds in process (order), with every
// event behind it, other tenants' too, so the hold looks again each
// second rather than keep them TenantOutageDelay past the tenant's return;
// a look at a server that refuses connections costs a refused connection.
const TenantOutageRecheck = time.Second

// NewLedgers returns the fleet's consumer ledgers. outbox writes the
// retries; its table must not name a schema (each tenant's pool puts its
// schema first in the search_path). control writes the retries and
// deferrals of a tenant whose database is out of reach into the control
// database's outbox. ledger configures each tenant's ledger.
func NewLedgers(fleet *Fleet, outbox *pgoutbox.Outbox, control *pgoutbox.Rescheduler, ledger pgledger.Config, logger *slog.Logger) (*Ledgers, error) {
	if fleet == nil || outbox == nil || control == nil {
		return nil, errors.New("tenancy: NewLedgers needs the fleet, an outbox and the control database's rescheduler")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Ledgers{fleet: fleet, outbox: outbox, control: control, ledger: ledger, logger: logger, m: map[string]*tenantLedger{}, slots: map[string]chan struct{}{}}, nil
}

// Once implements middleware.Ledger on the ledger of ctx's tenant.
//
// A tenant whose database is out of reach defers its event
// (pipeline.Defer, TenantOutageDelay) instead of waiting it out in the
// handler as a single database's outage is: the consumers are every
// tenant's, and one tenant's outage holding them would be paid by all.
//
// A session lost while its database answers (terminated, reset) is not an
// outage: the delivery is tried once more at once, on a new connection,
// rather than deferred TenantOutageDelay (the chaos run's terminated
// sessions cost 10 s deferrals).
func (l *Ledgers) Once(ctx context.Context, consumer, messageID string, digest []byte, fn func(ctx context.Context) error) (bool, error) {
	tl, tctx, release, err := l.enter(ctx)
	if err != nil {
		return false, err
	}
	defer release()
	ran, err := tl.ledger.Once(tctx, consumer, messageID, digest, fn)
	if unavailable(err) && answers(tctx, tl.pool) {
		ran, err = tl.ledger.Once(tctx, consumer, messageID, digest, fn)
	}
	if unavailable(err) {
		return ran, l.outage(ctx, err)
	}
	return ran, err
}

func unavailable(err error) bool {
	return err != nil && pipeline.IsInfrastructure(err) && pgdb.Unavailable(err)
}

// answers reports whether pool's database answers a ping within a second
// (tctx names the tenant, For). A ping that fails closes its connection,
// so the pings go through the pool's idle connections, dead after a mass
// termination, until one answers, a new one at the latest.
func answers(tctx context.Context, pool *pgxpool.Pool) bool {
	ctx, cancel := context.WithTimeout(tctx, time.Second)
	defer cancel()
	for range pool.Stat().MaxConns() + 1 {
		if err := pool.Ping(ctx); err == nil {
			return true
		} else if ctx.Err() != nil || !pgdb.Unavailable(err) {
			return false
		}
	}
	return false
}

// OnceBatch implements middleware.BatchLedger on the ledger of ctx's
// tenant: the batch is one transaction on its database (middleware's
// Batcher fills a batch per tenant). A batch takes one of the tenant's
// MaxHandlers slots. When the tenant's database is out of reach the batch
// fails, and each message, tried alone, is deferred (Once).
func (l *Ledgers) OnceBatch(ctx context.Context, consumer string, entries []pipeline.LedgerEntry, fn func(ctx context.Context, fresh []int) error) ([]pipeline.LedgerResult, error) {
	tl, tctx, release, err := l.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer release()
	return tl.ledger.OnceBatch(tctx, consumer, entries, fn)
}

// enter is a delivery's way into the ledger of ctx's tenant: the ledger
// and its pool, ctx naming the tenant for its pool (For), and one of the
// tenant's MaxHandlers slots, which release gives back.
func (l *Ledgers) enter(ctx context.Context) (tl *tenantLedger, tctx context.Context, release func(), err error) {
	tl, t, err := l.of(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	if release, err = l.slot(ctx, t); err != nil {
		return nil, nil, nil, err
	}
	return tl, For(ctx, t), release, nil
}

// ErrOutOfReach is in the deferral of an event whose tenant's database is
// out of reach: an ordered partition parks such an event (Parking).
var ErrOutOfReach = errors.New("its database is out of reach")

// outage defers the event of a tenant whose database is out of reach. The
// cause is kept as text only: wrapped, its Infrastructure mark would make
// the chain wait it out in the handler after all.
func (l *Ledgers) outage(ctx context.Context, err error) error {
	delay := TenantOutageDelay
	if pipeline.IsPartition(message.HandlerNameFromCtx(ctx)) {
		delay = TenantOutageRecheck
	}
	return pipeline.Defer(fmt.Errorf("tenant %q: %w: %s", pipeline.TenantIDFromContext(ctx), ErrOutOfReach, err), delay)
}

// ScheduleRetry implements middleware.RetryScheduler in ctx's tenant's
// outbox, or in the control database's while the tenant's is out of reach
// (the retry carries its tenant_id, and comes back to it).
func (l *Ledgers) ScheduleRetry(ctx context.Context, r pipeline.Retry) error {
	tl, t, err := l.of(ctx)
	if err != nil {
		if _, deferred := pipeline.Deferred(err); deferred {
			return l.control.ScheduleRetry(ctx, r)
		}
		return err
	}
	err = tl.retries.ScheduleRetry(For(ctx, t), r)
	if err != nil && pipeline.IsInfrastructure(err) {
		if cerr := l.control.ScheduleRetry(ctx, r); cerr == nil {
			return nil
		}
	}
	return err
}

func (l *Ledgers) of(ctx context.Context) (*tenantLedger, pgtenants.Tenant, error) {
	id := pipeline.TenantIDFromContext(ctx)
	if id == "" {
		return nil, pgtenants.Tenant{}, pipeline.Permanent(ErrNoTenant)
	}
	t, err := l.fleet.Tenant(ctx, id)
	if errors.Is(err, pgtenants.ErrNotFound) {
		return nil, t, pipeline.Permanent(fmt.Errorf("tenant %q: %w", id, ErrUnknownTenant))
	}
	if err != nil {
		return nil, t, pipeline.Infrastructure(fmt.Errorf("reading tenant %q from the registry: %w", id, err))
	}
	pool, err := l.fleet.pools.Pool(ctx, t)
	if err != nil {
		if ctx.Err() != nil {
			return nil, t, err
		}
		return nil, t, l.outage(ctx, err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	tl := l.m[id]
	if tl == nil || tl.pool != pool {
		ledger, err := pgledger.New(pool, l.ledger, l.logger)
		if err != nil {
			return nil, t, err
		}
		retries, err := pgoutbox.NewRescheduler(pool, l.outbox)
		if err != nil {
			return nil, t, err
		}
		tl = &tenantLedger{pool: pool, ledger: ledger, retries: retries}
		l.m[id] = tl
	}
	return tl, t, nil
}

// Bounds of a tenant's handlers (pgtenants.Tenant.MaxHandlers).
const (
	// TenantBusyWait is how long a message of a tenant at its bound waits
	// for one of its handlers to finish before it is deferred: long
	// enough that a steady stream waits in process, short enough that a
	// backlog does not hold the consumers every tenant shares.
	TenantBusyWait = time.Second
	// TenantBusyDelay is how long such a message then waits in its
	// tenant's outbox (pipeline.Defer: no attempt spent).
	TenantBusyDelay = 5 * time.Second
)

// slot takes one of t's handler slots in this process (MaxHandlers; none
// to take without a bound), deferring the message when none frees up
// within TenantBusyWait.
func (l *Ledgers) slot(ctx context.Context, t pgtenants.Tenant) (release func(), err error) {
	if t.MaxHandlers <= 0 {
		return func() {}, nil
	}
	l.mu.Lock()
	ch := l.slots[t.ID]
	if ch == nil || cap(ch) != t.MaxHandlers {
		// A changed bound starts a new set of slots; the handlers holding
		// the old ones release them there.
		ch = make(chan struct{}, t.MaxHandlers)
		l.slots[t.ID] = ch
	}
	l.mu.Unlock()
	timer := time.NewTimer(TenantBusyWait)
	defer timer.Stop()
	select {
	case ch <- struct{}{}:
		return func() { <-ch }, nil
	case <-timer.C:
		return nil, pipeline.Defer(fmt.Errorf("tenant %q has %d messages in this process's handlers, its bound (max handlers)", t.ID, t.MaxHandlers), TenantBusyDelay)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
