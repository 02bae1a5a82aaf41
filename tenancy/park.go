package tenancy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgparked"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
)

// Parking keeps an ordered partition going while one of its tenants'
// databases is out of reach. A partition is every tenant's: held behind
// one tenant's event, as a partition holds behind a failing head, it
// would make every tenant wait out that tenant's outage. Instead the
// event is parked in the control database (pgparked) and its delivery
// acked; every later event of that tenant in that partition is parked
// behind it, in order, while the group holds any; the other tenants' go
// on. Once the tenant's database answers, a process of the fleet sends
// the group back into the partition's queue, in order (Service), and
// each event is removed once handled there.
//
// The control database holds the parked events, so the partition's next
// consumer (another process after a failover) finds them; while the
// control database is out of reach, the partitions wait (the link's
// read is Ferry's infrastructure).
type Parking struct {
	fleet  *Fleet
	store  pgparked.Store
	pub    message.Publisher
	logger *slog.Logger

	mu     sync.Mutex
	logged map[string]bool // groups whose parking this process logged
}

// ParkInterval is how often the fleet looks for parked events whose
// tenant answers again: the delay a tenant's events see after its
// database is back.
const ParkInterval = time.Second

// NewParking returns the fleet's parking: store in the control database,
// pub the broker's publisher (the relay's) that sends parked events back.
func NewParking(fleet *Fleet, store pgparked.Store, pub message.Publisher, logger *slog.Logger) (*Parking, error) {
	if fleet == nil || store.Pool == nil || pub == nil {
		return nil, errors.New("tenancy: NewParking needs the fleet, the control database's store and a publisher")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Parking{fleet: fleet, store: store, pub: pub, logger: logger.With("component", "tenant-parking"), logged: map[string]bool{}}, nil
}

// Middleware is the park link: inside the infrastructure link (its read
// of the control database is waited out), outside the quick retries and
// the ledger, whose deferral of an unreachable tenant (ErrOutOfReach) it
// turns into a parked event. It does nothing but on an ordered partition.
func (p *Parking) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		consumer := message.HandlerNameFromCtx(ctx)
		tenant := pipeline.TenantIDFromContext(ctx)
		if !pipeline.IsPartition(consumer) || tenant == "" {
			return h(msg)
		}
		seq, _ := strconv.ParseInt(msg.Metadata.Get(pipeline.MetaParkedSeq), 10, 64)
		behind, err := p.store.Admit(ctx, consumer, tenant, seq)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, pipeline.Infrastructure(err)
		}
		if behind {
			if err := p.park(ctx, msg, consumer, tenant, seq, "behind the tenant's events parked before it"); err != nil {
				return nil, pipeline.Infrastructure(err)
			}
			return nil, nil
		}
		produced, err := h(msg)
		switch {
		case errors.Is(err, ErrOutOfReach):
			if perr := p.park(ctx, msg, consumer, tenant, seq, pipeline.ErrorText(err, 500)); perr != nil {
				// The partition holds, as it did before parking, and
				// looks again each TenantOutageRecheck.
				p.logger.WarnContext(ctx, "cannot park the event of a tenant out of reach; the partition holds", "consumer", consumer, "tenant_id", tenant, "error", perr)
				return produced, err
			}
			return nil, nil
		case seq > 0 && !errors.Is(err, context.Canceled):
			// Handled, or failed for a reason of its own, which the
			// partition's hold and the poison store carry from here.
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			derr := p.store.Done(dctx, seq)
			cancel()
			if derr != nil {
				// Kept, it would hold the tenant's group: the event
				// runs again (its ledger makes that a no-op) until its
				// row goes.
				return nil, pipeline.Infrastructure(derr)
			}
		}
		return produced, err
	}
}

// park parks msg at the end of its group, or, sent back already (seq),
// again in its place.
func (p *Parking) park(ctx context.Context, msg *message.Message, consumer, tenant string, seq int64, reason string) error {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if seq > 0 {
		found, err := p.store.Unsend(wctx, seq, reason)
		if err != nil || found {
			return err
		}
		// Handled already and come again: parked anew, it runs once
		// more later, a no-op for its ledger.
	}
	if err := p.store.Park(wctx, consumer, tenant, pipeline.MessageID(msg), msg.Payload, parkedHeaders(msg), reason); err != nil {
		return err
	}
	key := consumer + "/" + tenant
	p.mu.Lock()
	first := !p.logged[key]
	p.logged[key] = true
	p.mu.Unlock()
	if first {
		p.logger.WarnContext(ctx, "tenant out of reach: parking its events of an ordered partition; the partition goes on with the other tenants",
			"consumer", consumer, "tenant_id", tenant, "reason", reason)
	}
	return nil
}

// parkedHeaders are msg's metadata without what described its delivery.
func parkedHeaders(msg *message.Message) map[string]string {
	h := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		switch {
		case k == pipeline.MetaParkedSeq, k == "x-delivery-count", k == "x-death",
			strings.HasPrefix(k, "x-first-death-"), strings.HasPrefix(k, "x-last-death-"):
			continue
		}
		h[k] = v
	}
	return h
}

// Service is the sender: every ParkInterval it sends back, in order, the
// parked events of each tenant whose database answers again (and of a
// tenant removed meanwhile, which the consumers then poison with that
// reason). Every process with consumers runs it; one at a time sends a
// group.
func (p *Parking) Service() periodic.Service {
	return periodic.Service{Name: "tenant-parking", Interval: ParkInterval, Immediate: true, ErrorMessage: "sending parked events back failed", Tick: p.sendBack}
}

func (p *Parking) sendBack(ctx context.Context) error {
	groups, err := p.store.Groups(ctx, true)
	if err != nil {
		return err
	}
	var errs []error
	reachable := map[string]bool{}
	for _, g := range groups {
		ok, seen := reachable[g.TenantID]
		if !seen {
			ok = p.reachable(ctx, g.TenantID)
			reachable[g.TenantID] = ok
		}
		if !ok {
			continue
		}
		n, err := p.store.Send(ctx, g, p.send)
		switch {
		case errors.Is(err, pgparked.ErrBusy):
		case err != nil:
			errs = append(errs, fmt.Errorf("sending back the parked events of tenant %q in %s: %w", g.TenantID, g.Consumer, err))
		case n > 0:
			p.mu.Lock()
			delete(p.logged, g.Consumer+"/"+g.TenantID)
			p.mu.Unlock()
			p.logger.InfoContext(ctx, "tenant back: its parked events sent back to their partition, in order", "consumer", g.Consumer, "tenant_id", g.TenantID, "events", n)
		}
	}
	return errors.Join(errs...)
}

// reachable reports whether tenant id's database answers; a tenant the
// registry no longer holds is sent back too, to be poisoned with the
// reason rather than kept forever.
func (p *Parking) reachable(ctx context.Context, id string) bool {
	t, err := p.fleet.Tenant(ctx, id)
	if errors.Is(err, pgtenants.ErrNotFound) {
		return true
	}
	if err != nil {
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	pool, err := p.fleet.pools.Pool(rctx, t)
	return err == nil && answers(For(rctx, t), pool)
}

// send publishes events to their partition's queue through the retry
// exchange, which addresses one queue (a partition's), in order.
func (p *Parking) send(ctx context.Context, events []pgparked.Event) error {
	msgs := make([]*message.Message, len(events))
	for i, e := range events {
		m := message.NewMessage(e.MessageID, e.Payload)
		for k, v := range e.Headers {
			m.Metadata.Set(k, v)
		}
		m.Metadata.Set(pipeline.MetaRetryQueue, pipeline.ConsumerQueue(e.Consumer))
		m.Metadata.Set(pipeline.MetaParkedSeq, strconv.FormatInt(e.Seq, 10))
		m.SetContext(ctx)
		msgs[i] = m
	}
	return p.pub.Publish(pipeline.RetryTopic, msgs...)
}
