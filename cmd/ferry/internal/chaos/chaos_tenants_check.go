package chaos

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/tenancy"
)

// tenantsCheck checks a tenants run's invariants per tenant.
type tenantsCheck struct {
	control  *app.App
	tenants  []*chaosTenant
	provider *sandbox.PaymentProvider
	sink     *sandbox.SMTPSink
}

// tenantOf is the tenant of a user id the run made ("t3-user-07").
func tenantOf(user string) string {
	id, _, _ := strings.Cut(user, "-user-")
	return id
}

// effects are the effects the sandbox saw, by tenant and order: charges
// (one per idempotency key), mails (one per Message-ID), audit events by
// tenant.
type effects struct {
	charges map[string]int // "tenant/order" → charges
	mails   map[string]int // "tenant/order" → distinct mails
	audit   map[string]int // tenant → audit events
}

func (c *tenantsCheck) effects() effects {
	e := effects{charges: map[string]int{}, mails: map[string]int{}, audit: map[string]int{}}
	for _, ch := range c.provider.Charges() {
		e.charges[tenantOf(ch.Customer)+"/"+ch.OrderID]++
	}
	seen := map[string]bool{}
	for _, m := range c.sink.Mails() {
		if seen[m.MessageID] || len(m.To) == 0 {
			continue
		}
		seen[m.MessageID] = true
		user, _, _ := strings.Cut(m.To[0], "@")
		e.mails[tenantOf(user)+"/"+strings.TrimPrefix(m.Subject, "Your order #")]++
	}
	for _, a := range c.provider.Audit() {
		e.audit[tenantOf(a.Aggregate)]++
	}
	return e
}

// committedOrders are the orders in t's database.
func committedOrders(ctx context.Context, t *chaosTenant) ([]string, error) {
	rows, err := t.drv.Pool().Query(ctx, `SELECT id::text FROM orders ORDER BY id`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// batchCounts are the batch route's counts by order in t's database.
func batchCounts(ctx context.Context, t *chaosTenant) (map[string]int, error) {
	rows, err := t.drv.Pool().Query(ctx, `SELECT order_id, n FROM `+ChaosBatchTable)
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	var id string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error {
		out[id] = n
		return nil
	})
	return out, err
}

// effectsIn reports whether every committed order of t has its charge,
// its mail and its audit event, or its message in the poison store, and
// nothing of t is due in its outbox.
func (c *tenantsCheck) effectsIn(ctx context.Context, t *chaosTenant) (bool, error) {
	var r TenantReport
	poisoned, err := c.poisoned(ctx, &TenantsReport{})
	if err != nil {
		return false, err
	}
	if _, err := c.tenant(ctx, t, c.effects(), poisoned, &r); err != nil {
		return false, err
	}
	return r.Lost == 0 && r.PendingDue == 0, nil
}

// run checks every tenant into rep; done reports whether every effect is
// in (nothing lost, nothing due): the drain is over.
func (c *tenantsCheck) run(ctx context.Context, rep *TenantsReport) (done bool, err error) {
	e := c.effects()
	rep.ChargeRequests, rep.MaxChargeRequestsPerOrder = c.provider.Requests(), c.provider.MaxRequestsPerKey()
	if rep.MaxChargeRequestsPerOrder > maxChargeRequests {
		rep.Violations = append(rep.Violations, fmt.Sprintf("a charge was requested %d times: more than its attempts allow (%d), a hot loop",
			rep.MaxChargeRequestsPerOrder, maxChargeRequests))
	}
	// Every tenant's messages, to tell a ledger row in the wrong database.
	owner := map[string]string{}
	for _, t := range c.tenants {
		ids, err := messageIDs(ctx, t.drv.Pool(), t.drv.OutboxTable())
		if err != nil {
			return false, fmt.Errorf("tenant %s's outbox: %w", t.id, err)
		}
		for _, id := range ids {
			owner[id] = t.id
		}
	}
	poisoned, err := c.poisoned(ctx, rep)
	if err != nil {
		return false, err
	}
	rep.Tenants, rep.OrdersCommitted, rep.Lost, rep.Duplicated, rep.Crossed, rep.OrderViolations, rep.Poisoned, rep.PendingDue = nil, 0, 0, 0, 0, 0, 0, 0
	done = true
	known := map[string]bool{}
	for _, t := range c.tenants {
		r := TenantReport{ID: t.id, Server: string(rune('A' + t.server)), Role: t.role}
		violations, err := c.tenant(ctx, t, e, poisoned, &r)
		if err != nil {
			return false, fmt.Errorf("tenant %s: %w", t.id, err)
		}
		rep.Violations = append(rep.Violations, violations...)
		if err := crossed(ctx, t, owner, &r, rep); err != nil {
			return false, fmt.Errorf("tenant %s's ledger: %w", t.id, err)
		}
		known[t.id] = true
		rep.Tenants = append(rep.Tenants, r)
		rep.OrdersCommitted += r.Committed
		rep.Lost += r.Lost
		rep.Duplicated += r.Duplicated
		rep.Crossed += r.Crossed
		rep.OrderViolations += r.OrderViolations
		rep.Poisoned += r.Poisoned
		rep.PendingDue += r.PendingDue
		done = done && r.Lost == 0 && r.PendingDue == 0
	}
	// Nothing of a tenant in the control database's ledger.
	ids, err := ledgerIDs(ctx, c.control)
	if err != nil {
		return false, fmt.Errorf("the control database's ledger: %w", err)
	}
	rep.ControlLedgerRows = 0
	for _, id := range ids {
		if t, ok := owner[id]; ok {
			rep.ControlLedgerRows++
			rep.Crossed++
			rep.Violations = append(rep.Violations, fmt.Sprintf("message %s of tenant %s has a ledger row in the control database", id, t))
		}
	}
	// No effect for a tenant or an order nobody committed.
	for key, n := range e.charges {
		if !known[strings.Split(key, "/")[0]] && n > 0 {
			rep.Violations = append(rep.Violations, fmt.Sprintf("a charge for %s: no such tenant", key))
		}
	}
	// Per aggregate (a tenant's user), audit events in commit order.
	order := auditOrder(c.provider.Audit())
	rep.OrderViolations += len(order)
	rep.Violations = append(rep.Violations, order...)
	return done, nil
}

// poisoned are the poisoned messages' orders by tenant ("" key: audit
// events, whose aggregate is a user): each reason must be a fault the run
// injected, or, for the removed tenant, its removal. The tenant is removed
// once its effects are in, so a message of its poisoned for that reason is
// a copy in flight when it went (a relay's second send, a deferral coming
// back): counted apart (rep.PoisonedAfterRemoval), and not as the order's
// effect, so that an effect missing still counts as lost.
func (c *tenantsCheck) poisoned(ctx context.Context, rep *TenantsReport) (map[string]map[string]bool, error) {
	recs, err := c.control.Poison().List(ctx, "", 0)
	if err != nil {
		return nil, err
	}
	removed := map[string]bool{}
	for _, t := range c.tenants {
		removed[t.id] = t.role == "removed"
	}
	rep.PoisonedAfterRemoval = 0
	out := map[string]map[string]bool{}
	for _, pm := range recs {
		t := pm.Headers[pipeline.MetaTenantID]
		if removed[t] && strings.Contains(pm.Reason, tenancy.ErrUnknownTenant.Error()) {
			rep.PoisonedAfterRemoval++
			continue
		}
		if out[t] == nil {
			out[t] = map[string]bool{}
		}
		out[t][pm.Topic+"/"+pm.AggregateID] = true
		if !injectedFault(pm.Reason) {
			rep.Violations = append(rep.Violations, fmt.Sprintf("poisoned message %d (%s, tenant %q) for a reason no fault injected: %.200s", pm.ID, pm.Topic, t, pm.Reason))
		}
	}
	return out, nil
}

// tenant checks t's orders against the effects and the poison store into
// r, and says what went wrong.
func (c *tenantsCheck) tenant(ctx context.Context, t *chaosTenant, e effects, poisoned map[string]map[string]bool, r *TenantReport) ([]string, error) {
	ids, err := committedOrders(ctx, t)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	placed, rolledBack := len(t.committed), t.rolledBack
	t.mu.Unlock()
	r.Committed, r.RolledBack = len(ids), rolledBack
	var violations []string
	if placed != len(ids) {
		violations = append(violations, fmt.Sprintf("tenant %s: %d orders committed by the driver but %d in its table", t.id, placed, len(ids)))
	}
	p := poisoned[t.id]
	auditPoisoned := 0
	for k := range p {
		if strings.HasPrefix(k, ChaosAuditTopic+"/") {
			auditPoisoned++
		}
	}
	r.Poisoned = len(p)
	for _, id := range ids {
		for _, eff := range []struct {
			what string
			n    int
		}{{"charge", e.charges[t.id+"/"+id]}, {"mail", e.mails[t.id+"/"+id]}} {
			switch {
			case eff.n > 1:
				r.Duplicated++
				violations = append(violations, fmt.Sprintf("tenant %s, order %s: %d %ss", t.id, id, eff.n, eff.what))
			case eff.n == 0 && !poisonedOrder(p, id):
				r.Lost++
				violations = append(violations, fmt.Sprintf("tenant %s, order %s: no %s and nothing in the poison store", t.id, id, eff.what))
			}
		}
	}
	r.Charges, r.Mails, r.Audit = 0, 0, e.audit[t.id]
	for key, n := range e.charges {
		if strings.HasPrefix(key, t.id+"/") {
			r.Charges += min(n, 1)
		}
	}
	for key, n := range e.mails {
		if strings.HasPrefix(key, t.id+"/") {
			r.Mails += min(n, 1)
		}
	}
	counted, err := batchCounts(ctx, t)
	if err != nil {
		return nil, err
	}
	committed := map[string]bool{}
	for _, id := range ids {
		committed[id] = true
		switch n := counted[id]; {
		case n > 1:
			r.Duplicated++
			violations = append(violations, fmt.Sprintf("tenant %s, order %s: counted %d times by the batch route", t.id, id, n))
		case n == 0 && !poisonedOrder(p, id):
			r.Lost++
			violations = append(violations, fmt.Sprintf("tenant %s, order %s: not counted by the batch route and nothing in the poison store", t.id, id))
		case n == 1:
			r.BatchEffects++
		}
	}
	for id := range counted {
		if !committed[id] {
			violations = append(violations, fmt.Sprintf("tenant %s: the batch route counted order %s, which it never committed", t.id, id))
		}
	}
	if r.Audit+auditPoisoned < len(ids) {
		r.Lost += len(ids) - r.Audit - auditPoisoned
		violations = append(violations, fmt.Sprintf("tenant %s: %d audit events committed but %d arrived (%d poisoned)", t.id, len(ids), r.Audit, auditPoisoned))
	}
	due, err := t.drv.OutboxTable().CountPending(ctx, t.drv.Pool(), pgoutbox.PendingFilter{Due: true})
	if err != nil {
		return nil, err
	}
	r.PendingDue = int(due)
	if due > 0 {
		violations = append(violations, fmt.Sprintf("tenant %s: %d due rows left undispatched", t.id, due))
	}
	return violations, nil
}

// poisonedOrder reports whether an event of order id is in p (by topic
// and aggregate).
func poisonedOrder(p map[string]bool, id string) bool {
	for k := range p {
		if strings.HasSuffix(k, "/"+id) {
			return true
		}
	}
	return false
}

// crossed counts t's ledger rows of another tenant's messages.
func crossed(ctx context.Context, t *chaosTenant, owner map[string]string, r *TenantReport, rep *TenantsReport) error {
	ids, err := ledgerIDs(ctx, t.drv)
	if err != nil {
		return err
	}
	for _, id := range ids {
		if owner[id] == t.id {
			r.LedgerRows++
		}
		if o, ok := owner[id]; ok && o != t.id {
			r.Crossed++
			rep.Violations = append(rep.Violations, fmt.Sprintf("message %s of tenant %s has a ledger row in tenant %s's database", id, o, t.id))
		}
	}
	return nil
}

// ledgerIDs are the message ids in a's ledger.
func ledgerIDs(ctx context.Context, a *app.App) ([]string, error) {
	rows, err := a.Pool().Query(ctx, `SELECT DISTINCT message_id FROM `+pgx.Identifier{pgledger.DefaultTable}.Sanitize())
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// messageIDs are the message ids of every row of an outbox.
func messageIDs(ctx context.Context, q pgoutbox.Reader, tbl pgoutbox.Table) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT message_uuid::text FROM `+tbl.Quoted()+` WHERE message_uuid IS NOT NULL`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// pollWithin polls cond every second until it holds, ctx ends or d passes.
func pollWithin(ctx context.Context, d time.Duration, cond func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	return nil
}
