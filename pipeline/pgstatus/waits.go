package pgstatus

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
)

// Wait is what keeps a message at the broker from a route that has not
// handled it: the route is paused, or the message's partition of an
// ordered route is held behind a head that keeps failing.
type Wait struct {
	Route string `json:"route"`
	// Kind is "paused" or "held".
	Kind string `json:"kind"`
	// Partition is the held partition (route@k); HeadMessageID its head.
	Partition     string    `json:"partition,omitempty"`
	HeadMessageID string    `json:"head_message_id,omitempty"`
	Since         time.Time `json:"since"`
	// By and Reason are the pause's; Reason is the head's last error for
	// a hold.
	By     string `json:"by,omitempty"`
	Reason string `json:"reason,omitempty"`
}

// String says the wait and what ends it, for an operator.
func (w Wait) String() string {
	since := w.Since.UTC().Format(time.RFC3339)
	if w.Kind == "paused" {
		return fmt.Sprintf("waiting at the broker for %s, paused since %s by %s (%s; ferry resume %s ends it)",
			w.Route, since, w.By, pipeline.CleanText(w.Reason, 200), w.Route)
	}
	return fmt.Sprintf("waiting at the broker behind the held head %s of partition %s (held since %s: %s; ferry held retry-now --route %s tries it now)",
		w.HeadMessageID, w.Partition, since, pipeline.CleanText(w.Reason, 200), w.Route)
}

// waits is what Find needs to tell a message's waits: the registered
// routes by topic, the pauses, the live holds by partition.
type waits struct {
	byTopic map[string][]Route
	paused  map[string]pgpause.Pause
	held    map[string]pgheld.Partition
}

func readWaits(ctx context.Context, tx pgx.Tx) (waits, error) {
	w := waits{byTopic: map[string][]Route{}, paused: map[string]pgpause.Pause{}, held: map[string]pgheld.Partition{}}
	routes, err := Routes(ctx, tx)
	if err != nil || len(routes) == 0 {
		// No route registered (consumers of an earlier version): nothing
		// to tell more than the ledger says.
		return w, err
	}
	for _, r := range routes {
		w.byTopic[r.Topic] = append(w.byTopic[r.Topic], r)
	}
	pauses, err := pgpause.List(ctx, tx)
	if err != nil {
		return w, err
	}
	for _, p := range pauses {
		w.paused[p.Handler] = p
	}
	holds, err := pgheld.List(ctx, tx)
	if err != nil {
		return w, err
	}
	for _, h := range holds {
		w.held[h.Consumer] = h
	}
	return w, nil
}

// explain sets tr's waits, and its Now, when it was dispatched, is not
// pending, held or poisoned, and a route of its topic that has not handled
// it is paused or holds its partition.
func (w waits) explain(tr *Trail) {
	handled := map[string]bool{}
	dispatched := false
	for _, s := range tr.Sightings {
		switch {
		case s.Pending, s.Store == "held partition", s.Store == "poison store":
			return
		case s.Store == "ledger":
			handled[s.Consumer] = true
		case s.Dispatched:
			dispatched = true
		}
	}
	if !dispatched {
		return
	}
	tr.WaitingBehind = w.of(tr.Topic, tr.AggregateID, tr.MessageID, handled)
	if len(tr.WaitingBehind) == 0 {
		return
	}
	says := make([]string, len(tr.WaitingBehind))
	for i, wt := range tr.WaitingBehind {
		says[i] = wt.String()
	}
	if len(handled) > 0 {
		tr.Now = tr.Now + "; " + strings.Join(says, "; ")
		return
	}
	tr.Now = strings.Join(says, "; ")
}

// of is what keeps a dispatched message (its topic, aggregate and id) from
// the routes of its topic that have not handled it (handled: by route).
func (w waits) of(topic, aggregateID, messageID string, handled map[string]bool) []Wait {
	var out []Wait
	for _, r := range w.byTopic[topic] {
		if handled[r.Route] {
			continue
		}
		if p, ok := w.paused[r.Route]; ok {
			out = append(out, Wait{Route: r.Route, Kind: "paused", Since: p.At, By: p.By, Reason: p.Reason})
			continue
		}
		if !r.Ordered {
			continue
		}
		part := pipeline.PartitionName(r.Route, pipeline.PartitionOf(aggregateID, r.Partitions))
		if h, ok := w.held[part]; ok && h.MessageID != messageID {
			out = append(out, Wait{Route: r.Route, Kind: "held", Partition: part, HeadMessageID: h.MessageID, Since: h.Since, Reason: h.LastError})
		}
	}
	return out
}
