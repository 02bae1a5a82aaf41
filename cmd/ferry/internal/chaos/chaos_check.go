package chaos

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// What a run checks at its end: every committed order charged and mailed
// exactly once, in order per aggregate, nothing poisoned that should not
// be, and the report that says so.

func chargesByOrder(p *sandbox.PaymentProvider) map[string]int {
	out := map[string]int{}
	for _, c := range p.Charges() {
		out[c.OrderID]++
	}
	return out
}

// mailsByOrder counts distinct mails (by Message-ID, which a receiver
// deduplicates on) per order, from their subject "Your order #N".
func mailsByOrder(s *sandbox.SMTPSink) map[string]int {
	seen := map[string]bool{}
	out := map[string]int{}
	for _, m := range s.Mails() {
		if seen[m.MessageID] {
			continue
		}
		seen[m.MessageID] = true
		out[strings.TrimPrefix(m.Subject, "Your order #")]++
	}
	return out
}

// auditOrder says where audit events arrived out of commit order: seq
// must increase per aggregate.
func auditOrder(entries []sandbox.AuditEntry) []string {
	var out []string
	last := map[string]int64{}
	for _, e := range entries {
		if prev, ok := last[e.Aggregate]; ok && e.Seq <= prev {
			out = append(out, fmt.Sprintf("aggregate %s: audit seq %d after %d", e.Aggregate, e.Seq, prev))
		}
		last[e.Aggregate] = e.Seq
	}
	return out
}

// injectedFault reports whether a poison reason is one of the handler
// faults the run injects (chaos_faults.go), and nothing else.
func injectedFault(reason string) bool {
	return strings.Contains(reason, injectedFailureText) || strings.Contains(reason, injectedPanic)
}

func checkChaos(ctx context.Context, a *app.App, p *sandbox.PaymentProvider, s *sandbox.SMTPSink, committedKeys []string, expectAudit int, rep *ChaosReport) error {
	var ids []string
	rows, err := a.Pool().Query(ctx, `SELECT id::text FROM orders ORDER BY id`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return err
		}
		ids = append(ids, id)
	}
	rows.Close()
	if len(ids) != len(committedKeys) {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d orders committed by the driver but %d in the table", len(committedKeys), len(ids)))
	}
	poisoned, err := a.Poison().List(ctx, "", 0)
	if err != nil {
		return err
	}
	poisonedOrder := map[string]bool{}
	poisonedBatch := map[string]bool{} // by order, the batch route's own
	for _, pm := range poisoned {
		if pipeline.RouteName(pm.Consumer) == ChaosBatchRoute {
			poisonedBatch[pm.AggregateID] = true
		}
		rep.Poisoned++
		if strings.TrimSpace(pm.Reason) == "" {
			rep.Violations = append(rep.Violations, fmt.Sprintf("poisoned message %d has no reason", pm.ID))
		} else if !injectedFault(pm.Reason) {
			// Only a handler that failed on purpose may poison a message:
			// a database or broker fault is infrastructure, waited out.
			rep.Violations = append(rep.Violations, fmt.Sprintf("poisoned message %d (%s) for a reason no fault injected: %.200s", pm.ID, pm.Topic, pm.Reason))
		}
		reason := pm.Reason
		if i := strings.Index(reason, ":"); i > 0 && i < 60 {
			reason = reason[:i]
		}
		rep.PoisonReasons[reason]++
		poisonedOrder[pm.AggregateID] = true
	}
	charges, mails := chargesByOrder(p), mailsByOrder(s)
	rep.ChargeRequests, rep.Charges, rep.AuditEvents = p.Requests(), len(p.Charges()), len(p.Audit())
	rep.MaxChargeRequestsPerOrder = p.MaxRequestsPerKey()
	if rep.MaxChargeRequestsPerOrder > maxChargeRequests {
		rep.Violations = append(rep.Violations, fmt.Sprintf("a charge was requested %d times: more than its attempts allow (%d), a hot loop",
			rep.MaxChargeRequestsPerOrder, maxChargeRequests))
	}
	mailCount := len(s.Mails())
	for _, n := range mails {
		rep.Mails += n
	}
	rep.MailDuplicates = mailCount - rep.Mails
	committed := map[string]bool{}
	for _, id := range ids {
		committed[id] = true
		for what, n := range map[string]int{"charge": charges[id], "mail": mails[id]} {
			switch {
			case n > 1:
				rep.Duplicated++
				rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: %d %ss", id, n, what))
			case n == 0 && !poisonedOrder[id]:
				rep.Lost++
				rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: no %s and nothing in the poison store", id, what))
			}
		}
	}
	seen := map[string]int{}
	rows, err = a.Pool().Query(ctx, `SELECT order_id, n FROM `+ChaosBatchTable)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			rows.Close()
			return err
		}
		seen[id] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, id := range ids {
		switch n := seen[id]; {
		case n > 1:
			rep.Duplicated++
			rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: counted %d times by the batch route", id, n))
		case n == 0 && !poisonedBatch[id]:
			rep.Lost++
			rep.Violations = append(rep.Violations, fmt.Sprintf("order %s: not counted by the batch route and nothing of it in the poison store", id))
		case n == 1:
			rep.BatchEffects++
		}
	}
	for id := range seen {
		if !committed[id] {
			rep.Orphans++
			rep.Violations = append(rep.Violations, fmt.Sprintf("the batch route counted order %s, which was never committed", id))
		}
	}
	for id := range charges {
		if !committed[id] {
			rep.Orphans++
			rep.Violations = append(rep.Violations, fmt.Sprintf("a charge for order %s, which was never committed", id))
		}
	}
	for id := range mails {
		if !committed[id] {
			rep.Orphans++
			rep.Violations = append(rep.Violations, fmt.Sprintf("a mail for order %s, which was never committed", id))
		}
	}
	order := auditOrder(p.Audit())
	rep.OrderViolations += len(order)
	rep.Violations = append(rep.Violations, order...)
	if rep.AuditEvents+rep.Poisoned < expectAudit {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d audit events committed but %d arrived", expectAudit, rep.AuditEvents))
	}
	due, err := a.OutboxTable().CountPending(ctx, a.Pool(), pgoutbox.PendingFilter{Due: true})
	if err != nil {
		return err
	}
	rep.PendingDue = int(due)
	outboxRows, err := a.OutboxTable().Rows(ctx, a.Pool(), pgoutbox.RowFilter{})
	if err != nil {
		return err
	}
	for _, r := range outboxRows {
		if r.Attempts > 1 {
			rep.RelayRetries++
		}
		if r.Topic == pipeline.RetryTopic {
			rep.DurableRetries++
		}
	}
	if rep.PendingDue > 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d due rows left undispatched", rep.PendingDue))
	}
	rep.Violations = capViolations(rep.Violations)
	return nil
}

// capViolations keeps a report readable: the first 20 violations, and
// how many more.
func capViolations(v []string) []string {
	if len(v) > 20 {
		return append(v[:20], fmt.Sprintf("… and %d more", len(v)-20))
	}
	return v
}

// handlerFaultsSeen counts the injected handler failures and panics in the
// log at path: the faults a run promised must have happened, since a run
// whose faults never fired proves nothing about them (a violation into
// violations, when asked for and absent).
func handlerFaultsSeen(path string, failRate, panicRate float64, violations *[]string) (failures, panics int) {
	if b, err := os.ReadFile(path); err == nil {
		failures, panics = strings.Count(string(b), injectedFailureText), strings.Count(string(b), injectedPanic)
	}
	if failRate > 0 && failures == 0 {
		*violations = append(*violations, fmt.Sprintf("handler failures were asked for (rate %.3f) but none shows in %s", failRate, filepath.Base(path)))
	}
	if panicRate > 0 && panics == 0 {
		*violations = append(*violations, fmt.Sprintf("handler panics were asked for (rate %.3f) but none shows in %s", panicRate, filepath.Base(path)))
	}
	return failures, panics
}

func printChaosReport(w io.Writer, r ChaosReport, logDir string) {
	var b strings.Builder
	fmt.Fprintf(&b, "Ferry chaos run (seed %d, relay mode %s): %.1fs placing orders, %.1fs draining\n", r.Seed, r.RelayMode, r.ProducingSeconds, r.DrainSeconds)
	fmt.Fprintf(&b, "  orders committed       %6d   (+%d rolled back after publishing, %d replays deduped)\n", r.OrdersCommitted, r.OrdersRolledBack, r.OrderReplays)
	var faults []string
	total := 0
	for _, k := range []string{"kill_relay", "kill_consumer", "rolling_restart", "rolling_restart_sigterm", "rolling_restart_sigkill", "terminate_db_backends", "close_amqp_connections", "provider_non_utf8", "restart_broker", "database_refuses_connections",
		"broker_node_lost", "database_failover", "version_consumers_v2", "version_consumers_v3", "network_black_hole", "network_resets",
		"broker_black_hole", "db_black_hole", "db_latency", "broker_latency", "broker_resets", "db_resets", "db_slow_close", "broker_bandwidth"} {
		if n, ok := r.Faults[k]; ok {
			faults = append(faults, fmt.Sprintf("%s %d", k, n))
			total += n
		}
	}
	fmt.Fprintf(&b, "  faults injected        %6d   (%s; only faults that hit something count; a network fault only if it met work in flight)\n", total, strings.Join(faults, ", "))
	if len(r.Network) > 0 {
		met := 0
		for _, nf := range r.Network {
			if nf.MetWork {
				met++
			}
		}
		fmt.Fprintf(&b, "  network faults         %6d   (%d met work in flight; commit → charge of the orders committed during each; bound p99 %.0fs where marked *)\n", len(r.Network), met, r.NetworkBoundSeconds)
		for _, nf := range r.Network {
			mark := " "
			if nf.Bounded {
				mark = "*"
			}
			fmt.Fprintf(&b, "    +%4.0fs %-18s on %s for %4.1fs  met work %-5t  %4d orders  p50 %5.2fs  p99 %5.2fs%s max %5.2fs\n",
				nf.At, nf.Kind, nf.Process, nf.Seconds, nf.MetWork, nf.Orders, nf.P50, nf.P99, mark, nf.Max)
		}
	}
	if len(r.FaultsMissed) > 0 {
		var missed []string
		for k, n := range r.FaultsMissed {
			missed = append(missed, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(missed)
		fmt.Fprintf(&b, "  faults that hit nothing       (%s: no live process, no backend, or cut short by the run's end; not counted)\n", strings.Join(missed, ", "))
	}
	fmt.Fprintf(&b, "  handler faults seen    %6d   (%d injected failures, %d injected panics in the consumers' log)\n", r.HandlerFailuresSeen+r.HandlerPanicsSeen, r.HandlerFailuresSeen, r.HandlerPanicsSeen)
	if r.DatabaseOutageSeconds > 0 {
		fmt.Fprintf(&b, "  database outage        %6.1fs  (the database refused every connection; the driver stood still; %d charges were waiting)\n", r.DatabaseOutageSeconds, r.ChargesWaitingAtOutage)
	}
	if r.HA {
		fmt.Fprintf(&b, "  clusters               3 RabbitMQ nodes (quorum queues), PostgreSQL primary + synchronous standby\n")
		fmt.Fprintf(&b, "  broker node lost       %6.1fs  (the node the connections were on, stopped and back)\n", r.BrokerNodeLostSeconds)
		fmt.Fprintf(&b, "  database failover      %6.1fs  (the primary crashed, the standby promoted; %d order attempts repeated by the driver)\n", r.FailoverSeconds, r.OrderRetries)
	}
	fmt.Fprintf(&b, "  charges                %6d   (%d provider requests: %d retries and replays absorbed by the Idempotency-Key; at most %d for one charge)\n",
		r.Charges, r.ChargeRequests, r.ChargeRequests-r.Charges, r.MaxChargeRequestsPerOrder)
	fmt.Fprintf(&b, "  mails                  %6d   (%d duplicate deliveries dropped by Message-ID)\n", r.Mails, r.MailDuplicates)
	fmt.Fprintf(&b, "  ordered audit events   %6d   (%d order violations)\n", r.AuditEvents, r.OrderViolations)
	fmt.Fprintf(&b, "  consumer stops         %6d   (rolling restarts, each process replaced first; %d drains began with messages in handlers; %d partition holds met; %d effects a handler ran again, kept single by their keys)\n", r.ConsumerStops, r.StopsMetWork, r.PartitionHolds, r.EffectReplays)
	if r.ProducerVersion > 0 {
		fmt.Fprintf(&b, "  version roll           v1 → v%d (to v2 consumers first, to v3 producers first: %d orders read by older code through its down step; old and new code at once); %d poisoned by version 1's bug, requeued under version 3\n", r.ProducerVersion, r.VersionAhead, r.VersionRequeued)
	}
	fmt.Fprintf(&b, "  retries                %6d   (%d durable retries of failed handlers, %d rows that needed more than one relay attempt)\n", r.DurableRetries+r.RelayRetries, r.DurableRetries, r.RelayRetries)
	fmt.Fprintf(&b, "  poisoned               %6d   %v\n", r.Poisoned, r.PoisonReasons)
	fmt.Fprintf(&b, "  lost                   %6d\n", r.Lost)
	fmt.Fprintf(&b, "  duplicated             %6d\n", r.Duplicated)
	fmt.Fprintf(&b, "  batch route effects    %6d\n", r.BatchEffects)
	fmt.Fprintf(&b, "  effects w/o order      %6d\n", r.Orphans)
	fmt.Fprintf(&b, "  due rows left          %6d\n", r.PendingDue)
	if r.OK() {
		b.WriteString("ok: nothing lost, nothing twice\n")
	} else {
		fmt.Fprintf(&b, "FAILED (process logs kept in %s):\n", logDir)
		for _, v := range r.Violations {
			b.WriteString("  - " + v + "\n")
		}
	}
	_, _ = io.WriteString(w, b.String())
}

// logTail is the last line of each child log in dir, for an error that
// must say why without sending anyone to a temporary directory.
func logTail(dir string) string {
	files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	var tails []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if last := lines[len(lines)-1]; last != "" {
			tails = append(tails, filepath.Base(f)+": "+pipeline.CleanText(last, 400))
		}
	}
	if len(tails) == 0 {
		return "(nothing logged)"
	}
	return strings.Join(tails, " | ")
}
