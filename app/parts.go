package app

import (
	"cmp"
	"database/sql"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/adoption/cutoff"
	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// Pool is the app's PostgreSQL pool (search_path set to
// FERRY_DATABASE_SCHEMA when given).
func (a *App) Pool() *pgxpool.Pool { return a.pool }

// DB is the same pool as a *sql.DB, for database/sql code.
func (a *App) DB() *sql.DB { return a.db }

// Outbox publishes events in a caller's transaction.
func (a *App) Outbox() *pgoutbox.Outbox { return a.outbox }

// OutboxTable is the outbox table the app writes and relays
// (FERRY_OUTBOX_TABLE, in FERRY_DATABASE_SCHEMA): the handle its typed
// reads and operator views take.
func (a *App) OutboxTable() pgoutbox.Table { return a.outbox.Table() }

// Topology is the broker topology of the route table (exchange and queue
// names, the ordered topics); read it, do not change it.
func (a *App) Topology() *rabbit.Topology { return a.topology }

// Poison is the poison store: read it, requeue or discard from it.
func (a *App) Poison() *pgpoison.Store { return a.poison }

// Metrics holds the app's Prometheus metrics (its Registry takes a
// service's own collectors too).
func (a *App) Metrics() *metrics.Metrics { return a.metrics }

// Tools runs the application's agent tools (nil without Options.Tools).
func (a *App) Tools() *agenttools.Runner { return a.tools }

// Cutoff routes aggregates to the outbox or the legacy path by their
// creation time (Config.Cutoff).
func (a *App) Cutoff() *cutoff.Cutoff { return a.cutoff }

// Ledger is the consumers' idempotency ledger: which handler processed
// which message.
func (a *App) Ledger() *pgledger.Ledger { return a.ledger }

// Routes are the route table New built (a copy).
func (a *App) Routes() []handlers.Route { return slices.Clone(a.routes) }

// Stats are the app's running totals: what its relay dispatched, what its
// consumers skipped as duplicates, and, in CDC mode, the stream's.
type Stats struct {
	Relay pgoutbox.RelayStats
	// Duplicates are deliveries the ledger found already processed.
	Duplicates int64
	// CDC is the WAL stream's (nil unless FERRY_RELAY_MODE=cdc), with its
	// slot and publication.
	CDC            *pgcdc.Stats
	CDCSlot        string
	CDCPublication string
}

// Stats returns the totals since New.
func (a *App) Stats() Stats {
	var st Stats
	if a.relay != nil {
		st.Relay = a.relay.Stats()
	}
	if a.idempotency != nil {
		st.Duplicates = a.idempotency.Duplicates()
	}
	if a.cdc != nil {
		cs := a.cdc.Stats()
		st.CDC, st.CDCSlot, st.CDCPublication = &cs, a.cdc.Slot(), a.cdc.Publication()
	}
	return st
}

// OrderedTopics is the sorted set of topics consumed in per-aggregate order:
// those of routes marked Ordered plus FERRY_ORDERED_TOPICS. The topology
// holds it; the relay and the outbox read it from there.
func (a *App) OrderedTopics() []string { return a.topology.OrderedTopics() }

// Config returns the configuration the app runs with (defaults applied).
func (a *App) Config() Config { return a.cfg }

// routeRegistry is the route table as pgstatus.RegisterRoutes records it.
func (a *App) routeRegistry() []pgstatus.Route {
	out := make([]pgstatus.Route, len(a.routes))
	for i, r := range a.routes {
		out[i] = pgstatus.Route{Route: r.Name, Topic: r.Topic, Ordered: r.Ordered, Partitions: 1}
		if r.Ordered {
			out[i].Partitions = cmp.Or(a.cfg.AMQP.Partitions, rabbit.DefaultPartitions)
		}
	}
	return out
}
