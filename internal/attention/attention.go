// Package attention turns what `ferry status` and the console's overview
// collect into one list of what needs a human, worded once so that the two
// never disagree about what is stuck.
package attention

import (
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// CDCRetained is how much WAL an idle CDC slot may retain before it is
// worth a human's look (the server keeps it until the slot is streamed or
// removed).
const CDCRetained = 1 << 30

// reasonWidth bounds a quoted reason: it comes from messages and
// providers, anyone may have written it.
const reasonWidth = 100

// State is what the list is made from. Fields left nil or empty were not
// collected and say nothing.
type State struct {
	Report pgstatus.Report
	// BrokerError is why the broker could not be asked; empty when it was.
	BrokerError string
	// Unrouted is the depth of the unrouted queue, nil when unknown.
	Unrouted *int
	// Queues are the route table's queues, as a passive declare saw them.
	Queues []rabbit.QueueStat
	// CDC is the CDC relay's slot, when there is one to watch.
	CDC *pgcdc.SlotStatus
	// Command is the binary's name in hints (default "ferry").
	Command string
	// OutboxRetention, LedgerRetention and PruneInterval judge the weekly
	// partitions of the outbox and the ledger: one still holding rows a
	// prune interval (and an hour's grace) after all of them passed
	// retention is waiting for a prune that does not come or cannot lock
	// it. Zero retention: not judged.
	OutboxRetention, LedgerRetention, PruneInterval time.Duration
	// Tenants are the tenant fleet's tenants that need a human (ferry
	// tenants status); nil when there is no fleet or it was not read.
	Tenants []Tenant
}

// Tenant is a tenant of the fleet that needs a human, and why.
type Tenant struct {
	ID    string   `json:"id"`
	Needs []string `json:"needs"`
}

// tenantsShown bounds the tenants one item names: a server down takes
// many tenants with it, and the item says how many.
const tenantsShown = 5

// Item is one thing that needs a human: what kind of thing, which one (a
// route, a queue, a slot), how many of it, since when, what to do, and the
// sentence that says all of it. One outage is one item with a count, not
// one line per partition or queue.
type Item struct {
	// Kind names the check: broker_unreachable, no_relay, paused_handler, held_partitions,
	// queue_without_consumer, poison, retrying, failing_rows, cdc_slot,
	// outbox_retention, ledger_retention, unrouted, tenants.
	Kind string `json:"kind"`
	// Target is what it is about (a route, a queue, a slot); empty when
	// it is the whole pipeline.
	Target string `json:"target,omitempty"`
	// Count is how many (partitions, queues, messages, rows); 1 for a
	// condition.
	Count int `json:"count"`
	// Since is when it started, when that is known.
	Since *time.Time `json:"since,omitempty"`
	// Hint says what to do.
	Hint string `json:"hint"`
	// Text is the item as one sentence (what `ferry status` prints).
	Text string `json:"text"`
	// Runbook is the anchor of the runbook in docs/operations.md for it
	// (RunbookURL gives the page's address), beside the same page's alert.
	Runbook string `json:"runbook,omitempty"`
}

// RunbookBase is where the runbooks are published (the alerts link the
// same page).
const RunbookBase = "https://github.com/ferry-dev/ferry/blob/main/docs/operations.md"

// runbooks maps an item's kind to its runbook's anchor: the runbook of
// the alert that pages for the same thing.
var runbooks = map[string]string{
	"broker_unreachable":     "runbook-ferrynoliverelay",
	"no_relay":               "runbook-ferrynoliverelay",
	"paused_handler":         "runbook-ferryhandlerpaused",
	"held_partitions":        "runbook-ferrypartitionheld",
	"queue_without_consumer": "runbook-ferryqueuewithoutconsumer",
	"poison":                 "runbook-ferrypoisonarriving",
	"retrying":               "runbook-ferryretriespilingup",
	"failing_rows":           "runbook-ferryoutboxrowretrying",
	"cdc_slot":               "runbook-ferrycdcretainedwal",
	"outbox_retention":       "runbook-ferryretentionoverdue",
	"ledger_retention":       "runbook-ferryretentionoverdue",
	"unrouted":               "runbook-ferryunroutedmessages",
	"tenants":                "runbook-ferrytenantrelayfailing",
}

// Runbooks are the runbook anchors of every kind of item, for a test that
// the page has them.
func Runbooks() map[string]string { return maps.Clone(runbooks) }

// RunbookURL is the address of its runbook, or "" for none.
func (it Item) RunbookURL() string {
	if it.Runbook == "" {
		return ""
	}
	return RunbookBase + "#" + it.Runbook
}

// List says what needs a human, most urgent first; empty when all is well.
func List(s State) []string {
	items := Items(s)
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.Text
	}
	return out
}

// Items is List with each item's kind, target, count, since and hint.
func Items(s State) []Item {
	cmd := s.Command
	if cmd == "" {
		cmd = "ferry"
	}
	rep := s.Report
	out := []Item{}
	add := func(it Item) {
		it.Runbook = runbooks[it.Kind]
		out = append(out, it)
	}
	if s.BrokerError != "" {
		add(Item{Kind: "broker_unreachable", Count: 1, Hint: "check FERRY_AMQP_URL and the broker",
			Text: "RabbitMQ unreachable (" + reason(s.BrokerError) + "): relays cannot dispatch and consumers receive nothing; check FERRY_AMQP_URL and the broker"})
	}
	if rep.RelaysAlive == 0 {
		add(Item{Kind: "no_relay", Count: 1, Hint: "start a relay (" + cmd + " relay, or " + cmd + " run)", Text: "no live relay: nothing is being dispatched"})
	}
	for _, p := range rep.Paused {
		since := p.At
		why := ""
		if p.Reason != "" {
			why = " (" + reason(p.Reason) + ")"
		}
		add(Item{Kind: "paused_handler", Target: p.Handler, Count: 1, Since: &since, Hint: "resume it when the incident is over (" + cmd + " resume " + p.Handler + ")",
			Text: fmt.Sprintf("handler %s paused by %s since %s%s: its messages wait; %s resume %s", display.Cell(p.Handler, 60), display.Cell(p.By, 60), stamp(p.At), why, cmd, display.Cell(p.Handler, 60))})
	}
	// Held partitions, one item per route: an outage of its provider holds
	// every partition of it at once.
	var routes []string
	held := map[string][]pgheld.Partition{}
	for _, h := range rep.Held {
		r := pipeline.RouteName(h.Consumer)
		if _, ok := held[r]; !ok {
			routes = append(routes, r)
		}
		held[r] = append(held[r], h)
	}
	for _, r := range routes {
		hs := held[r]
		oldest := hs[0]
		for _, h := range hs[1:] {
			if h.Since.Before(oldest.Since) {
				oldest = h
			}
		}
		since := oldest.Since
		hint := "fix what the error says; the head is retried with backoff and poisoned after its last attempt (" + cmd + " status shows each partition)"
		text := fmt.Sprintf("ordered partition %s held since %s behind message %s (next attempt %d): %s; the later events of its aggregates wait",
			display.Cell(oldest.Consumer, 60), stamp(oldest.Since), display.Cell(oldest.MessageID, 60), oldest.Attempt, reason(oldest.LastError))
		if len(hs) > 1 {
			text = fmt.Sprintf("%d ordered partitions of %s held, the oldest since %s behind message %s (next attempt %d): %s; the later events of their aggregates wait",
				len(hs), display.Cell(r, 60), stamp(oldest.Since), display.Cell(oldest.MessageID, 60), oldest.Attempt, reason(oldest.LastError))
		}
		add(Item{Kind: "held_partitions", Target: r, Count: len(hs), Since: &since, Hint: hint, Text: text})
	}
	// A paused route's consumers detach (its messages wait at the broker,
	// none held unacked): its queues are the paused item's, above.
	pausedRoutes := map[string]bool{}
	for _, p := range rep.Paused {
		pausedRoutes[p.Handler] = true
	}
	var idle []string
	idleReady := 0
	for _, q := range s.Queues {
		if q.Ready > 0 && q.Consumers == 0 && (q.Handler == "" || !pausedRoutes[pipeline.RouteName(q.Handler)]) {
			idle = append(idle, q.Queue)
			idleReady += q.Ready
		}
	}
	switch {
	case len(idle) == 1:
		add(Item{Kind: "queue_without_consumer", Target: idle[0], Count: 1, Hint: "start the consumers of its route (" + cmd + " consume)",
			Text: fmt.Sprintf("queue %s: %d message(s) ready and no consumer: start the consumers of its route (%s consume)", display.Cell(idle[0], 80), idleReady, cmd)})
	case len(idle) > 1:
		names := idle
		if len(names) > 3 {
			names = names[:3]
		}
		for i := range names {
			names[i] = display.Cell(names[i], 80)
		}
		more := ""
		if len(idle) > 3 {
			more = fmt.Sprintf(" and %d more", len(idle)-3)
		}
		add(Item{Kind: "queue_without_consumer", Count: len(idle), Hint: "start the consumers (" + cmd + " consume)",
			Text: fmt.Sprintf("%d queues with %d message(s) ready and no consumer (%s%s): start the consumers (%s consume)", len(idle), idleReady, strings.Join(names, ", "), more, cmd)})
	}
	switch ack := rep.PoisonAcknowledged; {
	case ack == nil && rep.PoisonTotal > 0:
		add(Item{Kind: "poison", Count: rep.PoisonTotal, Hint: "read why (" + cmd + " poison list --group), fix, then requeue or discard; " + cmd + " status --acknowledge once seen",
			Text: fmt.Sprintf("%d message(s) in the poison store (%s poison list)", rep.PoisonTotal, cmd)})
	case ack != nil && rep.PoisonNew > 0:
		// What was there at the acknowledgment was seen: only what
		// came since needs a human.
		at := ack.At
		add(Item{Kind: "poison", Count: rep.PoisonNew, Since: &at, Hint: "read why (" + cmd + " poison list --group), fix, then requeue or discard; " + cmd + " status --acknowledge once seen",
			Text: fmt.Sprintf("%d new message(s) in the poison store since %s acknowledged it at %s (%d in all; %s poison list)",
				rep.PoisonNew, display.Cell(ack.By, 60), stamp(ack.At), rep.PoisonTotal, cmd)})
	}
	if rep.RetryingTotal > 0 && len(rep.Retrying) > 0 {
		g := rep.Retrying[0]
		since := g.FirstFailed
		add(Item{Kind: "retrying", Target: g.Handler, Count: rep.RetryingTotal, Since: &since, Hint: "they retry on their own; " + cmd + " outbox retry-now --kind retrying once the cause is fixed",
			Text: fmt.Sprintf("%d message(s) retrying (most: %d for %s, failing since %s: %s)", rep.RetryingTotal, g.Count,
				display.Cell(g.Handler, 60), stamp(g.FirstFailed), reason(g.Example))})
	}
	if len(rep.Failing) > 0 {
		add(Item{Kind: "failing_rows", Count: len(rep.Failing), Hint: cmd + " outbox failing shows why the relay cannot publish them",
			Text: fmt.Sprintf("%d failing outbox row(s) tried more than %d times (of %d failing)", len(rep.Failing), rep.AttemptsThreshold, rep.FailingCount)})
	}
	if c := s.CDC; c != nil {
		switch {
		case !c.Exists:
			add(Item{Kind: "cdc_slot", Target: c.Name, Count: 1, Hint: "start the CDC relay",
				Text: fmt.Sprintf("CDC relay mode, but replication slot %s does not exist (the CDC relay creates it; the polling safety net relays meanwhile)", c.Name)})
		case c.WALStatus == "lost":
			add(Item{Kind: "cdc_slot", Target: c.Name, Count: 1, Hint: "nothing: the CDC relay recreates it",
				Text: fmt.Sprintf("replication slot %s was invalidated (max_slot_wal_keep_size); the CDC relay recreates it, the polling safety net relays what it missed", c.Name)})
		case !c.Active && c.RetainedBytes >= CDCRetained:
			add(Item{Kind: "cdc_slot", Target: c.Name, Count: 1, Hint: "start the CDC relay, or " + cmd + " cdc drop",
				Text: fmt.Sprintf("replication slot %s is not streamed and retains %d MiB of WAL: start the CDC relay, or remove the slot (%s cdc drop)", c.Name, c.RetainedBytes>>20, cmd)})
		}
	}
	for _, r := range []struct {
		table     string
		retention time.Duration
		parts     []pgweeks.Partition
		lockedBy  string
	}{
		{"outbox", s.OutboxRetention, rep.OutboxPartitions, "pg_dump, a long report"},
		{"ledger", s.LedgerRetention, rep.LedgerPartitions, "pg_dump, a consumer's long transaction"},
	} {
		late, since := pgweeks.Overdue(r.parts, rep.At, r.retention, s.PruneInterval)
		if len(late) == 0 {
			continue
		}
		add(Item{Kind: r.table + "_retention", Count: len(late), Since: &since,
			Hint: "run " + cmd + " prune " + r.table + " and read what it says; a transaction holding a lock on the " + r.table + " (" + r.lockedBy + ": see pg_locks) keeps a partition from being cleared",
			Text: fmt.Sprintf("%d %s partition(s) past retention since %s and not cleared: the %s keeps growing until they are", len(late), r.table, stamp(since), r.table)})
	}
	if len(s.Tenants) > 0 {
		// One item for the fleet: a tenant server down is one outage,
		// whatever the count of its tenants.
		names := make([]string, 0, tenantsShown)
		for _, t := range s.Tenants[:min(len(s.Tenants), tenantsShown)] {
			names = append(names, display.Cell(t.ID, 63)+" ("+reason(strings.Join(t.Needs, "; "))+")")
		}
		more := ""
		if n := len(s.Tenants) - len(names); n > 0 {
			more = fmt.Sprintf(" and %d more", n)
		}
		target := ""
		if len(s.Tenants) == 1 {
			target = s.Tenants[0].ID
		}
		add(Item{Kind: "tenants", Target: target, Count: len(s.Tenants), Hint: cmd + " tenants status",
			Text: fmt.Sprintf("%d tenant(s) need a human: %s%s; %s tenants status", len(s.Tenants), strings.Join(names, ", "), more, cmd)})
	}
	if s.Unrouted != nil && *s.Unrouted > 0 {
		add(Item{Kind: "unrouted", Count: *s.Unrouted, Hint: "publish only to topics a route consumes, or add the route",
			Text: fmt.Sprintf("%d unrouted message(s) in the broker: published to a topic no route consumes", *s.Unrouted)})
	}
	return out
}

func reason(s string) string { return display.Cell(s, reasonWidth) }

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }
