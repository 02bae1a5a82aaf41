package console

import (
	"net/http"
	"net/url"
	"time"

	"github.com/ferry-dev/ferry/internal/attention"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

type overview struct {
	Report      pgstatus.Report
	P95         *float64
	PoisonByHdl []countRow
	Unrouted    *int
	UnroutedErr string
	Queues      []rabbit.QueueStat
	QueuesErr   string
	Failing     int
	// Attention is the list `ferry status` prints under "needs attention",
	// each item with the console page to act on it from.
	Attention []attentionItem
	// Charts are the last hour, from the processes' samples; NoSamples
	// when no process has sampled in that hour.
	Charts    []chart
	NoSamples bool
	// Tenants is the tenant fleet's card (Config.Tenants), nil without.
	Tenants *tenantsCard
}

// tenantsCard is the overview's card of the tenant fleet, from the last
// read (Read zero: none finished yet; Err: it failed).
type tenantsCard struct {
	Count, NeedAHuman int
	Read              time.Time
	Err               bool
}

type countRow struct {
	Name  string
	Count int
}

func (c *Console) overview(r *http.Request) (overview, error) {
	ctx := r.Context()
	var o overview
	rep, err := pgstatus.Collect(ctx, c.pool, c.cfg.OutboxTable, pgstatus.DefaultAttemptsThreshold)
	if err != nil {
		return o, err
	}
	o.Report = rep
	if o.P95, err = pgstatus.DispatchP95(ctx, c.pool, latencyWindow); err != nil {
		return o, err
	}
	// One rule, one number: status's, the failing page's and the view's.
	o.Failing = rep.FailingCount
	byHandler, err := c.store.CountByHandler(ctx)
	if err != nil {
		return o, err
	}
	for _, h := range byHandler {
		o.PoisonByHdl = append(o.PoisonByHdl, countRow{Name: h.Name, Count: h.Count})
	}
	if c.cfg.Queues != nil {
		if o.Queues, err = c.cfg.Queues(ctx); err != nil {
			o.QueuesErr = "unknown (broker not reachable)"
		}
	}
	var brokerErr string
	if c.cfg.Unrouted == nil {
		// Never a blank card: say why there is no number.
		o.UnroutedErr = "unknown (this console is given no broker to read: Config.Unrouted)"
	}
	if c.cfg.Unrouted != nil {
		n, err := c.cfg.Unrouted(ctx)
		switch {
		case rabbit.IsQueueMissing(err):
			// The broker answered: the queue is not declared yet.
			o.UnroutedErr = "none yet (no relay has declared the topology)"
		case err != nil:
			o.UnroutedErr = "unknown (broker not reachable)"
			brokerErr = pipeline.CleanText(err.Error(), 300)
		default:
			o.Unrouted = &n
		}
	}
	pts, err := pgstatus.History(ctx, c.pool, time.Hour, time.Minute)
	if err != nil {
		return o, err
	}
	o.Charts = overviewCharts(pts)
	o.NoSamples = true
	for _, p := range pts {
		if p.Samples > 0 {
			o.NoSamples = false
		}
	}
	var tenants []attention.Tenant
	if c.cfg.Tenants != nil {
		// The last read, not one now: it connects to every tenant.
		rows, at, err := c.cachedTenants()
		o.Tenants = &tenantsCard{Read: at, Err: err != nil}
		for _, t := range rows {
			o.Tenants.Count++
			if len(t.Attention) > 0 {
				o.Tenants.NeedAHuman++
				tenants = append(tenants, attention.Tenant{ID: t.ID, Needs: t.Attention})
			}
		}
	}
	for _, it := range attention.Items(attention.State{Report: rep, BrokerError: brokerErr, Unrouted: o.Unrouted, Queues: o.Queues, Tenants: tenants,
		OutboxRetention: c.cfg.OutboxRetention, LedgerRetention: c.cfg.LedgerRetention, PruneInterval: c.cfg.PruneInterval}) {
		o.Attention = append(o.Attention, attentionItem{Text: it.Text, Link: c.attentionLink(it, rep), Runbook: it.RunbookURL()})
	}
	return o, nil
}

func (c *Console) overviewPage(w http.ResponseWriter, r *http.Request) {
	o, err := c.overview(r)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "overview", &overviewPage{O: o})
}

func (c *Console) overviewPartial(w http.ResponseWriter, r *http.Request) {
	o, err := c.overview(r)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "overview-body", &overviewPage{O: o})
}

// attentionItem is one line of "needs attention" and where to act on it.
type attentionItem struct {
	Text string
	// Link is the console page for it; empty when the fix is outside
	// (the broker, a relay to start).
	Link string
	// Runbook is its runbook (the page the matching alert links).
	Runbook string
}

// attentionLink is the page an item is acted on from: the held head's own
// page for one held partition, the list for several.
func (c *Console) attentionLink(it attention.Item, rep pgstatus.Report) string {
	p := c.cfg.Prefix
	switch it.Kind {
	case "paused_handler":
		return p + "/handlers"
	case "tenants":
		return p + "/tenants"
	case "held_partitions":
		for _, h := range rep.Held {
			if it.Count == 1 && pipeline.RouteName(h.Consumer) == it.Target {
				return p + "/held/" + url.PathEscape(h.Consumer)
			}
		}
		return p + "/#held"
	case "queue_without_consumer":
		return p + "/#queues"
	case "poison":
		return p + "/poison"
	case "retrying":
		return p + "/retrying"
	case "failing_rows":
		return p + "/failing"
	}
	return ""
}
