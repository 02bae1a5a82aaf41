// Package attention turns what `ferry status` and the console's overview
// collect into one list of what needs a human, worded once so that the two
// never disagree about what is stuck.
package attention

import (
	"fmt"
	"time"

	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
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
}

// List says what needs a human, most urgent first; empty when all is well.
func List(s State) []string {
	cmd := s.Command
	if cmd == "" {
		cmd = "ferry"
	}
	rep := s.Report
	out := []string{}
	if s.BrokerError != "" {
		out = append(out, "RabbitMQ unreachable ("+reason(s.BrokerError)+"): relays cannot dispatch and consumers receive nothing; check FERRY_AMQP_URL and the broker")
	}
	if rep.RelaysAlive == 0 {
		out = append(out, "no live relay: nothing is being dispatched")
	}
	for _, h := range rep.Held {
		out = append(out, fmt.Sprintf("ordered partition %s held since %s behind message %s (next attempt %d): %s; the later events of its aggregates wait",
			display.Cell(h.Consumer, 60), stamp(h.Since), display.Cell(h.MessageID, 60), h.Attempt, reason(h.LastError)))
	}
	for _, q := range s.Queues {
		if q.Ready > 0 && q.Consumers == 0 {
			out = append(out, fmt.Sprintf("queue %s: %d message(s) ready and no consumer: start the consumers of its route (%s consume)", display.Cell(q.Queue, 80), q.Ready, cmd))
		}
	}
	if rep.PoisonTotal > 0 {
		out = append(out, fmt.Sprintf("%d message(s) in the poison store (%s poison list)", rep.PoisonTotal, cmd))
	}
	if rep.RetryingTotal > 0 && len(rep.Retrying) > 0 {
		g := rep.Retrying[0]
		out = append(out, fmt.Sprintf("%d message(s) retrying (most: %d for %s, failing since %s: %s)", rep.RetryingTotal, g.Count,
			display.Cell(g.Handler, 60), stamp(g.FirstFailed), reason(g.Example)))
	}
	if len(rep.Failing) > 0 {
		out = append(out, fmt.Sprintf("%d outbox row(s) with more than %d relay attempts", len(rep.Failing), rep.AttemptsThreshold))
	}
	if c := s.CDC; c != nil {
		switch {
		case !c.Exists:
			out = append(out, fmt.Sprintf("CDC relay mode, but replication slot %s does not exist (the CDC relay creates it; the polling safety net relays meanwhile)", c.Name))
		case c.WALStatus == "lost":
			out = append(out, fmt.Sprintf("replication slot %s was invalidated (max_slot_wal_keep_size); the CDC relay recreates it, the polling safety net relays what it missed", c.Name))
		case !c.Active && c.RetainedBytes >= CDCRetained:
			out = append(out, fmt.Sprintf("replication slot %s is not streamed and retains %d MiB of WAL: start the CDC relay, or remove the slot (%s cdc drop)", c.Name, c.RetainedBytes>>20, cmd))
		}
	}
	if s.Unrouted != nil && *s.Unrouted > 0 {
		out = append(out, fmt.Sprintf("%d unrouted message(s) in the broker: published to a topic no route consumes", *s.Unrouted))
	}
	return out
}

func reason(s string) string { return display.Cell(s, reasonWidth) }

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }
