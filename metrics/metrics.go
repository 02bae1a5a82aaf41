// Package metrics is Ferry's Prometheus instrumentation: the outbox gauges
// the alerts are written against, the relay's dispatch histograms, and the
// consumers' outcome counters. Names and labels are part of Ferry's
// interface (dashboards and alert rules use them); they are listed in
// docs/operations.md.
package metrics

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// DefaultRefreshInterval is how often the outbox gauges are recomputed: a
// count over the pending rows is cheap but not free, so it is done on an
// interval, never per scrape.
const DefaultRefreshInterval = 15 * time.Second

// Metrics holds Ferry's collectors on a registry of their own.
type Metrics struct {
	Registry *prometheus.Registry
	own      []prometheus.Collector
	// OutboxTable is the outbox table the gauges read. Default: the zero
	// Table, "outbox".
	OutboxTable pgoutbox.Table
	// Unrouted, if set, returns the depth of the broker's unrouted queue
	// (messages no binding took), for the ferry_unrouted_messages gauge.
	Unrouted func(context.Context) (int, error)
	// Queues, if set, inspects the route table's queues (ready messages
	// and consumers of each).
	Queues func(context.Context) ([]rabbit.QueueStat, error)
	// CDCSlot, if set, is the CDC relay's replication slot, read for the
	// ferry_cdc_slot_* and ferry_cdc_retained_wal_bytes gauges.
	CDCSlot string
	// CDC, if set, returns the in-process CDC streamer's state, for
	// ferry_cdc_slot_lag_seconds and ferry_cdc_streaming.
	CDC func() pgcdc.Stats
	// Tenants, if set, reads the tenant fleet's state in this process
	// (FERRY_TENANTS), for the ferry_tenant* gauges.
	Tenants func() TenantReadings
	// OutboxRetention, LedgerRetention and PruneInterval judge the weekly
	// partitions of the outbox and the ledger for the
	// ferry_retention_overdue_* gauges, as `ferry status` does
	// (pgweeks.Overdue). Zero retention: that table is not judged (its
	// gauges read 0).
	OutboxRetention, LedgerRetention, PruneInterval time.Duration

	overduePartitions *prometheus.GaugeVec
	overdueSeconds    *prometheus.GaugeVec
	tenantFailing     *prometheus.GaugeVec
	tenantsServed     prometheus.Gauge
	tenantConns       *prometheus.GaugeVec
	tenantDispatched  *prometheus.CounterVec
	cdcLagBytes       prometheus.Gauge
	cdcLagSeconds     prometheus.Gauge
	cdcRetained       prometheus.Gauge
	cdcConfirmed      prometheus.Gauge
	cdcSlotActive     prometheus.Gauge
	cdcStreaming      prometheus.Gauge
	pending           *prometheus.GaugeVec
	retrying          *prometheus.GaugeVec
	versions          *prometheus.GaugeVec
	shownVersions     map[[3]string]bool
	instances         *prometheus.GaugeVec
	held              *ageGauge
	paused            *ageGauge
	pauseInfo         *prometheus.GaugeVec
	queueReady        *prometheus.GaugeVec
	queueConsumers    *prometheus.GaugeVec
	pendingDue        *prometheus.GaugeVec
	oldestPendingAge  prometheus.Gauge
	maxAttempts       prometheus.Gauge
	poison            *prometheus.GaugeVec
	unrouted          prometheus.Gauge
	legacyEffects     *prometheus.GaugeVec
	dispatchLatency   *prometheus.HistogramVec
	attempts          prometheus.Histogram
	dispatched        *prometheus.CounterVec
	publishErrors     *prometheus.CounterVec
	shadowEvents      *prometheus.CounterVec
	consumer          *prometheus.CounterVec
	poisonCauses      *prometheus.CounterVec
	causesMu          sync.Mutex
	causes            map[string]map[string]bool
	batchSize         *prometheus.HistogramVec
	batches           *prometheus.CounterVec
	refreshErrors     prometheus.Counter
	// refreshed: the outbox gauges hold a reading (Counters reports no
	// depth before the first).
	refreshed atomic.Bool

	// Under refreshMu: the labels each gauge vector has shown (a label
	// that goes is set to 0, never dropped, so that an alert sees the
	// drop and an increase() its start).
	refreshMu sync.Mutex
	shown     map[*prometheus.GaugeVec]map[string]bool
}

// New creates the collectors, with Go runtime and process collectors.
func New() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		queueReady: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_queue_messages", Help: "Messages ready in a consumer queue of the route table (delivered and unacked ones not counted), with the route (handler) that consumes it.",
		}, []string{"queue", "handler"}),
		queueConsumers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_queue_consumers", Help: "Consumers of a queue of the route table, with the route (handler) that consumes it (0 with messages ready: nobody takes them, or the route is paused and its consumers detached).",
		}, []string{"queue", "handler"}),
		paused: newAgeGauge("ferry_handler_paused_seconds",
			"How long a handler has been paused (ferry pause, the console), by handler, at the scrape; 0 once resumed. Its messages wait at the broker meanwhile.",
			"handler"),
		pauseInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_handler_pause_info", Help: "1 for each paused handler, with who paused it (paused_by) and why (reason, personal data redacted, at most 100 characters): the alert's and the dashboard's words for the pause. Gone once resumed.",
		}, []string{"handler", "paused_by", "reason"}),
		held: newAgeGauge("ferry_partition_held_seconds",
			"How long an ordered partition has waited behind failing head messages in this outage (one clock across its heads, as the console and ferry status show it), by partition and its route (handler), at the scrape; 0 once released.",
			"consumer", "handler"),
		instances: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_instances", Help: "Ferry processes registered in ferry_instances, by component (relay, consumers) and state: alive (a recent heartbeat) or stale (none for 15s: died without deregistering).",
		}, []string{"component", "state"}),
		versions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_events_stored", Help: "Events still to be read (place: pending in the outbox, retry, poison), by topic and schema_version: an old version's upcast step may go once it is gone from here.",
		}, []string{"topic", "schema_version", "place"}),
		retrying: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_retrying_messages", Help: "Durable retries waiting in the outbox for their handler, by handler.",
		}, []string{"handler"}),
		pending: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_pending_total", Help: "Undispatched outbox rows, delayed and backed-off ones included.",
		}, []string{"topic"}),
		pendingDue: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_pending_due_total", Help: "Undispatched outbox rows that are due now (available_at <= now()).",
		}, []string{"topic"}),
		oldestPendingAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_oldest_pending_age_seconds", Help: "Age of the oldest due, undispatched outbox row (0 when none).",
		}),
		maxAttempts: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_pending_max_attempts", Help: "Most relay attempts of any undispatched outbox row.",
		}),
		poison: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_poison_messages", Help: "Messages in the poison store, by original topic.",
		}, []string{"topic"}),
		unrouted: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_unrouted_messages", Help: "Messages in the broker's unrouted queue: published to a topic no route consumes.",
		}),
		legacyEffects: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_legacy_effects_24h", Help: "Effects the legacy code recorded in the last 24 hours (shadow mode), by topic.",
		}, []string{"topic"}),
		dispatchLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "outbox_dispatch_latency_seconds", Help: "From when the outbox row became due (its creation, or the time a delay asked for) to the broker's confirm.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600},
		}, []string{"topic"}),
		attempts: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_attempts", Help: "Relay attempts a row needed, observed when it is dispatched.",
			Buckets: []float64{1, 2, 3, 4, 5, 6, 8, 10, 15, 20},
		}),
		dispatched: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_dispatched_total", Help: "Outbox rows the broker confirmed.",
		}, []string{"topic"}),
		publishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_publish_errors_total", Help: "Relay publishes that failed (the row is retried with backoff).",
		}, []string{"topic"}),
		shadowEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_shadow_events_total", Help: "Shadow intents the relay marked dispatched without publishing (shadow mode).",
		}, []string{"topic"}),
		poisonCauses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_poisoned_messages_total", Help: "Messages poisoned, by route (handler) and cause: the reason with its ids and numbers normalised away (at most 20 causes a route, then other).",
		}, []string{"handler", "cause"}),
		consumer: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_consumer_messages_total",
			Help: "Consumer outcomes per route: handled, duplicate, retry_scheduled, deferred, poisoned.",
		}, []string{"handler", "outcome"}),
		batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "ferry_consumer_batch_size", Help: "Messages per batch of a batch route.",
			Buckets: []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000},
		}, []string{"handler"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_consumer_batches_total", Help: "Batches of a batch route: committed, or failed as a whole (their messages then go one by one).",
		}, []string{"handler", "result"}),
		cdcLagBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_cdc_slot_lag_bytes", Help: "WAL between the server's current position and the CDC slot's confirmed position.",
		}),
		cdcLagSeconds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_cdc_slot_lag_seconds", Help: "Age of the oldest transaction the CDC relay received and has not confirmed (0 when caught up).",
		}),
		cdcRetained: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_cdc_retained_wal_bytes", Help: "WAL the CDC replication slot keeps on disk (from its restart position).",
		}),
		cdcConfirmed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_cdc_confirmed_lsn", Help: "The CDC slot's confirmed flush position, as a number (0: no slot).",
		}),
		cdcSlotActive: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_cdc_slot_active", Help: "1 when a CDC relay streams the slot, 0 when none does (or there is no slot).",
		}),
		cdcStreaming: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_cdc_streaming", Help: "1 when this process streams the slot, 0 when it stands by or reconnects.",
		}),
		overduePartitions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_retention_overdue_partitions", Help: "Weekly partitions (table: outbox, ledger) still holding rows a prune interval and an hour after they all passed retention: a prune that does not run, or a lock (pg_dump, a long transaction) that keeps it from clearing them.",
		}, []string{"table"}),
		overdueSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_retention_overdue_seconds", Help: "How long the oldest overdue partition (ferry_retention_overdue_partitions) has been past retention, by table (0 when none is overdue).",
		}, []string{"table"}),
		tenantFailing: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_tenant_relay_failing", Help: "1 while a tenant's outbox cannot be relayed (its database out of reach, its outbox unreadable), by tenant, from the fleet member that serves it; 0 once it can, or once another member serves it.",
		}, []string{"tenant"}),
		tenantsServed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ferry_tenants_served", Help: "Tenants whose outboxes this process relays (FERRY_TENANTS).",
		}),
		tenantConns: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ferry_tenant_connections", Help: "Connections this process holds to tenants' databases: kind pool (the tenants' pools, idle ones closed) or listen (one LISTEN per database).",
		}, []string{"kind"}),
		tenantDispatched: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_tenant_dispatched_total", Help: "Events relayed (broker-confirmed) per tenant. One series per tenant this process served: as many as the registry holds.",
		}, []string{"tenant"}),
		refreshErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ferry_metrics_refresh_errors_total", Help: "Failed refreshes of the outbox gauges.",
		}),
	}
	m.own = []prometheus.Collector{m.held, m.paused, m.pauseInfo, m.queueReady, m.queueConsumers, m.instances, m.retrying, m.versions, m.pending, m.pendingDue, m.oldestPendingAge, m.maxAttempts, m.poison, m.unrouted, m.legacyEffects,
		m.dispatchLatency, m.attempts, m.dispatched, m.publishErrors, m.shadowEvents, m.consumer, m.poisonCauses, m.batchSize, m.batches, m.refreshErrors,
		m.cdcLagBytes, m.cdcLagSeconds, m.cdcRetained, m.cdcConfirmed, m.cdcSlotActive, m.cdcStreaming,
		m.overduePartitions, m.overdueSeconds, m.tenantFailing, m.tenantsServed, m.tenantConns, m.tenantDispatched}
	m.Registry.MustRegister(m.own...)
	m.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// descName reads a metric's name out of its description: prometheus.Desc
// keeps it unexported and prints it as fqName: "…".
var descName = regexp.MustCompile(`fqName: "([^"]+)"`)

// Names returns the names of Ferry's own metrics, with the _bucket, _sum
// and _count series of its histograms: what a dashboard or an alert rule
// may query (Watermill's router metrics and the Go runtime's come beside
// them).
func (m *Metrics) Names() []string {
	var names []string
	for _, c := range m.own {
		ch := make(chan *prometheus.Desc, 4)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			match := descName.FindStringSubmatch(d.String())
			if match == nil {
				continue
			}
			switch c.(type) {
			case prometheus.Histogram, *prometheus.HistogramVec:
				names = append(names, match[1]+"_bucket", match[1]+"_sum", match[1]+"_count")
			default:
				names = append(names, match[1])
			}
		}
	}
	slices.Sort(names)
	return names
}

// Handler serves the registry in Prometheus' exposition format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry})
}

// ObserveRelay records a relay batch's outcomes (pgoutbox.RelayConfig.Observer).
func (m *Metrics) ObserveRelay(outcomes []pgoutbox.Outcome) {
	for _, o := range outcomes {
		if o.Shadowed {
			m.shadowEvents.WithLabelValues(o.Topic).Inc()
			continue
		}
		if o.Err != nil {
			m.publishErrors.WithLabelValues(o.Topic).Inc()
			continue
		}
		m.dispatched.WithLabelValues(o.Topic).Inc()
		m.attempts.Observe(float64(o.Attempt))
		// From when the row became due: a delay that was asked for (a
		// scheduled event, a durable retry) is not the relay being slow.
		from := o.DueAt
		if from.IsZero() {
			from = o.CreatedAt
		}
		if !from.IsZero() && !o.At.IsZero() {
			m.dispatchLatency.WithLabelValues(o.Topic).Observe(max(o.At.Sub(from), 0).Seconds())
		}
	}
}

// TenantReadings are the tenant fleet's state in this process.
type TenantReadings struct {
	// Failing says, for each tenant this process serves, whether its
	// outbox fails to be relayed.
	Failing map[string]bool
	// PoolConnections and ListenConnections are the connections held to
	// tenants' databases.
	PoolConnections, ListenConnections int
}

// ObserveTenant counts the events a tenant fleet relayed for tenant (the
// fleet's tenancy.Config.Observer).
func (m *Metrics) ObserveTenant(tenant string, outcomes []pgoutbox.Outcome) {
	n := 0
	for _, o := range outcomes {
		if o.Err == nil && !o.Shadowed {
			n++
		}
	}
	if n > 0 {
		m.tenantDispatched.WithLabelValues(tenant).Add(float64(n))
	}
}

func (m *Metrics) setTenants(r TenantReadings) {
	failing := make(map[string]float64, len(r.Failing))
	for t, f := range r.Failing {
		failing[t] = boolGauge(f)
	}
	m.setGauges(m.tenantFailing, failing)
	m.tenantsServed.Set(float64(len(r.Failing)))
	m.tenantConns.WithLabelValues("pool").Set(float64(r.PoolConnections))
	m.tenantConns.WithLabelValues("listen").Set(float64(r.ListenConnections))
}

// Counters sums this process's counters for the console's charts
// (pgstatus.Heartbeat.Counters): dispatches and their latency histogram,
// handler outcomes, and the outbox depth it last read.
func (m *Metrics) Counters() pgstatus.Counters {
	var c pgstatus.Counters
	families, err := m.Registry.Gather()
	if err != nil {
		return c
	}
	for _, f := range families {
		switch f.GetName() {
		case "outbox_dispatched_total":
			for _, mt := range f.GetMetric() {
				c.Dispatched += mt.GetCounter().GetValue()
			}
		case "outbox_dispatch_latency_seconds":
			for _, mt := range f.GetMetric() {
				h := mt.GetHistogram()
				if c.LatencyLE == nil {
					c.LatencyLE = map[string]float64{}
				}
				for _, b := range h.GetBucket() {
					c.LatencyLE[strconv.FormatFloat(b.GetUpperBound(), 'g', -1, 64)] += float64(b.GetCumulativeCount())
				}
				c.LatencyLE["+Inf"] += float64(h.GetSampleCount())
			}
		case "ferry_consumer_messages_total":
			for _, mt := range f.GetMetric() {
				v := mt.GetCounter().GetValue()
				for _, l := range mt.GetLabel() {
					if l.GetName() != "outcome" {
						continue
					}
					switch middleware.Outcome(l.GetValue()) {
					case middleware.OutcomeHandled, middleware.OutcomeDuplicate:
						c.Handled += v
					case middleware.OutcomeDeferred:
						// waiting behind its partition's head: not a failure of its own
					default:
						c.Failed += v
					}
				}
			}
		case "outbox_pending_total":
			if m.refreshed.Load() {
				var p float64
				for _, mt := range f.GetMetric() {
					p += mt.GetGauge().GetValue()
				}
				c.Pending = &p
			}
		}
	}
	if c.Pending == nil && m.refreshed.Load() {
		zero := 0.0 // an empty outbox exports no series
		c.Pending = &zero
	}
	return c
}

// setGauges sets vec's series to values, and to 0 every label it showed
// before and values lacks. The caller holds refreshMu.
func (m *Metrics) setGauges(vec *prometheus.GaugeVec, values map[string]float64) {
	if m.shown == nil {
		m.shown = map[*prometheus.GaugeVec]map[string]bool{}
	}
	shown := m.shown[vec]
	if shown == nil {
		shown = map[string]bool{}
		m.shown[vec] = shown
	}
	for label := range shown {
		if _, ok := values[label]; !ok {
			vec.WithLabelValues(strings.Split(label, labelSep)...).Set(0)
		}
	}
	for label, v := range values {
		shown[label] = true
		vec.WithLabelValues(strings.Split(label, labelSep)...).Set(v)
	}
}

// setPauses shows each pause's age, 0 for a handler resumed since, and
// its words (who, why) as the labels of a series of their own, removed
// with the pause: set as a whole each refresh (at most one per handler).
func (m *Metrics) setPauses(pauses []pgpause.Pause) {
	paused := make(map[string]time.Time, len(pauses))
	m.pauseInfo.Reset()
	for _, p := range pauses {
		paused[p.Handler] = p.At
		m.pauseInfo.WithLabelValues(p.Handler, pipeline.CleanText(p.By, 100), pipeline.RedactText(p.Reason, 100)).Set(1)
	}
	m.paused.set(paused)
}

// heldSince is each held partition's start, keyed by the labels of
// ferry_partition_held_seconds (partition, route): the hold's one clock,
// kept by pgheld across the outage's heads (a head poisoned and the next
// one failing in turn), so the console, status and this gauge show one
// number, and the gauge ends with the hold instead of counting on after
// recovery.
func heldSince(held []pgheld.Partition) map[string]time.Time {
	out := make(map[string]time.Time, len(held))
	for _, h := range held {
		out[h.Consumer+labelSep+h.Route()] = h.Since
	}
	return out
}

// labelSep joins a series' label values in setGauges' keys.
const labelSep = "\x00"

// InitRoutes creates the consumer outcome series of routes at 0, so that
// the first failure or poisoning of a route shows as an increase (a
// counter that appears at 1 shows none) and a quiet route as 0.
func (m *Metrics) InitRoutes(routes ...string) {
	for _, r := range routes {
		for _, o := range []middleware.Outcome{middleware.OutcomeHandled, middleware.OutcomeRetried, middleware.OutcomeRetryScheduled,
			middleware.OutcomeDeferred, middleware.OutcomePoisoned, middleware.OutcomeInfrastructureRetry} {
			m.consumer.WithLabelValues(r, string(o))
		}
	}
}

// Record implements middleware.Recorder.
func (m *Metrics) Record(handler string, outcome middleware.Outcome) {
	m.consumer.WithLabelValues(handler, string(outcome)).Inc()
}

// maxCauses bounds the causes one handler's poisonings are counted by;
// more are counted as "other".
const maxCauses = 20

// RecordPoisonCause implements middleware.CauseRecorder.
func (m *Metrics) RecordPoisonCause(handler, cause string) {
	m.causesMu.Lock()
	seen := m.causes[handler]
	if seen == nil {
		if m.causes == nil {
			m.causes = map[string]map[string]bool{}
		}
		seen = map[string]bool{}
		m.causes[handler] = seen
	}
	if !seen[cause] && len(seen) >= maxCauses {
		cause = "other"
	}
	seen[cause] = true
	m.causesMu.Unlock()
	m.poisonCauses.WithLabelValues(handler, cause).Inc()
}

// RecordBatch counts a batch of a batch route (middleware.BatchRecorder).
func (m *Metrics) RecordBatch(handler string, size int, committed bool) {
	m.batchSize.WithLabelValues(handler).Observe(float64(size))
	result := "committed"
	if !committed {
		result = "failed"
	}
	m.batches.WithLabelValues(handler, result).Inc()
}

// Refresh recomputes the outbox and poison gauges from the database (the
// same reads as `ferry status`).
func (m *Metrics) Refresh(ctx context.Context, pool *pgxpool.Pool) error {
	backlog, err := m.OutboxTable.Backlog(ctx, pool)
	if err != nil {
		return err
	}
	poison, err := pgpoison.Depth(ctx, pool)
	if err != nil {
		return err
	}
	m.refreshMu.Lock()
	defer m.refreshMu.Unlock()
	pending, due := map[string]float64{}, map[string]float64{}
	var maxAttempts int
	var oldest float64
	for _, b := range backlog {
		pending[b.Topic], due[b.Topic] = float64(b.Pending), float64(b.Due)
		maxAttempts = max(maxAttempts, b.MaxAttempts)
		oldest = max(oldest, b.OldestDueAgeS)
	}
	m.setGauges(m.pending, pending)
	m.setGauges(m.pendingDue, due)
	m.maxAttempts.Set(float64(maxAttempts))
	m.oldestPendingAge.Set(oldest)
	m.refreshed.Store(true)
	byTopic := map[string]float64{}
	for topic, n := range poison {
		byTopic[topic] = float64(n)
	}
	m.setGauges(m.poison, byTopic)
	retrying, _, err := m.OutboxTable.RetryGroups(ctx, pool, 1000)
	if err != nil {
		return err
	}
	byHandler := map[string]float64{}
	for _, g := range retrying {
		byHandler[g.Handler] += float64(g.Count)
	}
	m.setGauges(m.retrying, byHandler)
	versions, err := pgstatus.StoredVersions(ctx, pool, m.OutboxTable)
	if err != nil {
		return err
	}
	// A version gone from every place reads 0 rather than vanishing, so
	// that a dashboard shows it leave.
	now := map[[3]string]bool{}
	for _, v := range versions {
		key := [3]string{v.Topic, v.Version, v.Place}
		now[key] = true
		m.versions.WithLabelValues(key[:]...).Set(float64(v.Count))
	}
	if m.shownVersions == nil {
		m.shownVersions = map[[3]string]bool{}
	}
	for key := range m.shownVersions {
		if !now[key] {
			m.versions.WithLabelValues(key[:]...).Set(0)
		}
	}
	maps.Copy(m.shownVersions, now)
	held, err := pgheld.List(ctx, pool)
	if err != nil {
		return err
	}
	m.held.set(heldSince(held))
	pauses, err := pgpause.List(ctx, pool)
	if err != nil {
		return err
	}
	m.setPauses(pauses)
	instances, err := pgstatus.Instances(ctx, pool)
	if err != nil {
		return err
	}
	for _, c := range []string{"relay", "consumers"} {
		for _, st := range []string{"alive", "stale"} {
			m.instances.WithLabelValues(c, st).Set(0)
		}
	}
	for _, in := range instances {
		state := "stale"
		if in.Alive {
			state = "alive"
		}
		for _, c := range []string{"relay", "consumers"} {
			if strings.Contains(in.Components, c) {
				m.instances.WithLabelValues(c, state).Inc()
			}
		}
	}
	if err := m.refreshRetention(ctx, pool); err != nil {
		return err
	}
	legacy, err := shadow.LegacyEffects(ctx, pool)
	if err != nil {
		return err
	}
	m.legacyEffects.Reset()
	for topic, n := range legacy {
		m.legacyEffects.WithLabelValues(topic).Set(float64(n))
	}
	if m.Queues != nil {
		stats, err := m.Queues(ctx)
		if err != nil {
			return fmt.Errorf("inspecting the consumer queues: %w", err)
		}
		m.queueReady.Reset()
		m.queueConsumers.Reset()
		for _, st := range stats {
			route := ""
			if st.Handler != "" {
				route = pipeline.RouteName(st.Handler)
			}
			m.queueReady.WithLabelValues(st.Queue, route).Set(float64(st.Ready))
			m.queueConsumers.WithLabelValues(st.Queue, route).Set(float64(st.Consumers))
		}
	}
	if m.Tenants != nil {
		m.setTenants(m.Tenants())
	}
	if m.Unrouted != nil {
		n, err := m.Unrouted(ctx)
		if err != nil {
			return fmt.Errorf("reading the unrouted queue's depth: %w", err)
		}
		m.unrouted.Set(float64(n))
	}
	if m.CDC != nil {
		st := m.CDC()
		m.cdcLagSeconds.Set(st.Lag.Seconds())
		m.cdcStreaming.Set(boolGauge(st.Active))
	}
	if m.CDCSlot != "" {
		slot, err := pgcdc.ReadSlot(ctx, pool, m.CDCSlot)
		if err != nil {
			return err
		}
		m.cdcLagBytes.Set(float64(slot.LagBytes))
		m.cdcRetained.Set(float64(slot.RetainedBytes))
		m.cdcSlotActive.Set(boolGauge(slot.Active))
		var lsn float64
		if slot.Exists {
			if l, err := pglogrepl.ParseLSN(slot.ConfirmedLSN); err == nil {
				lsn = float64(l)
			}
		}
		m.cdcConfirmed.Set(lsn)
	}
	return nil
}

// refreshRetention sets the ferry_retention_overdue_* gauges of both
// tables (a table not judged, or not partitioned, reads 0: an alert sees
// it clear).
func (m *Metrics) refreshRetention(ctx context.Context, pool *pgxpool.Pool) error {
	outbox, now, err := m.OutboxTable.Partitions(ctx, pool)
	if err != nil {
		return err
	}
	ledger, _, err := pgledger.Partitions(ctx, pool)
	if err != nil {
		return err
	}
	for _, t := range []struct {
		name      string
		parts     []pgweeks.Partition
		retention time.Duration
	}{{"outbox", outbox, m.OutboxRetention}, {"ledger", ledger, m.LedgerRetention}} {
		late, since := pgweeks.Overdue(t.parts, now, t.retention, m.PruneInterval)
		var age float64
		if len(late) > 0 {
			age = max(0, now.Sub(since).Seconds())
		}
		m.overduePartitions.WithLabelValues(t.name).Set(float64(len(late)))
		m.overdueSeconds.WithLabelValues(t.name).Set(age)
	}
	return nil
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// RunRefresher refreshes the gauges every interval until ctx ends.
func (m *Metrics) RunRefresher(ctx context.Context, pool *pgxpool.Pool, interval time.Duration, logger *slog.Logger) {
	m.Refresher(pool, interval).Run(ctx, logger)
}

// Refresher is the background service that refreshes the gauges every
// interval (the first at once); a failed refresh counts in
// ferry_metrics_refresh_errors_total and is logged when it changes.
func (m *Metrics) Refresher(pool *pgxpool.Pool, interval time.Duration) periodic.Service {
	if interval <= 0 {
		interval = DefaultRefreshInterval
	}
	return periodic.Service{Name: "metrics-refresher", Interval: interval, Immediate: true,
		ErrorMessage: "refreshing outbox metrics failed",
		Tick: func(ctx context.Context) error {
			err := m.Refresh(ctx, pool)
			if err != nil && ctx.Err() == nil {
				m.refreshErrors.Inc()
			}
			return err
		}}
}
