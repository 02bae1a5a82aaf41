package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
)

var (
	cmdRun = &Command{Name: "run", Summary: "run the relay, the consumers, the HTTP API (if the application has one) and the hourly pruning in one process",
		Flags: serveFlags(app.All)}
	cmdRelay = &Command{Name: "relay", Summary: "run only the outbox relay (run several for throughput and failover)",
		Flags: serveFlags(app.Components{Relay: true})}
	cmdConsume = &Command{Name: "consume", Summary: "run only the consumers (every handler of the route table)",
		Flags: serveFlags(app.Components{Consumers: true})}
	cmdServe = &Command{Name: "serve", Summary: "run only the application's HTTP API and agent tool endpoints (it writes to the outbox; relays and consumers run elsewhere)",
		Flags: serveFlags(app.Components{HTTP: true})}
	cmdMigrate = &Command{Name: "migrate", Summary: "apply, roll back or list database migrations (Ferry's, then the application's)", Sub: []*Command{
		{Name: "up", Summary: "apply every pending migration", Flags: migrateFlags("up")},
		{Name: "down", Summary: "roll back the newest applied migration (of the application's sets first)", Flags: migrateFlags("down")},
		{Name: "status", Summary: "list migrations and whether each is applied", Flags: migrateFlags("status")},
	}}
	cmdStatus = &Command{Name: "status", Summary: "pending per topic, oldest pending, rows failing with their last error, retries, held partitions, broker queues, poison and unrouted depth, relay/consumer liveness, the tenant fleet (FERRY_TENANTS=true); exits 3 when something needs a human",
		Flags: statusFlags}
	cmdPoison = &Command{Name: "poison", Summary: "inspect and act on the poison store", Sub: []*Command{
		{Name: "list", Summary: "what is in the poison store, why, since when (paged by id, streamed)", Flags: poisonFlags("list")},
		{Name: "show", Args: "ID", Summary: "one poisoned message whole: full reason, attempt history, headers, payload", Flags: poisonShowFlags},
		{Name: "requeue", Summary: "send poisoned messages back to their original topic (attempts reset), atomically: an interrupted requeue loses and doubles nothing",
			Flags: poisonFlags("requeue")},
		{Name: "discard", Summary: "remove poisoned messages into the archive (undoable until FERRY_POISON_ARCHIVE_RETENTION); unknown ids are named and fail the command", Flags: poisonFlags("discard")},
		{Name: "undo", Summary: "put back the messages one discard (--run) removed, with their ids; audited", Flags: poisonUndoFlags},
	}}
	cmdPrune = &Command{Name: "prune", Summary: "remove rows past their retention", Sub: []*Command{
		{Name: "outbox", Summary: "empty (or archive, then empty) the outbox's weekly partitions past their retention, their pending rows moved to the current week first", Flags: pruneFlags(pgretention.Outbox)},
		{Name: "ledger", Summary: "remove consumer ledger rows past their retention (weeks whole, by TRUNCATE)", Flags: pruneFlags(pgretention.Ledger)},
		{Name: "tool-calls", Summary: "remove agent tool call records (idempotency) past their retention", Flags: pruneFlags(pgretention.ToolCalls)},
		{Name: "poison-archive", Summary: "remove discarded poison messages past their retention (they can no longer be undone)", Flags: pruneFlags(pgretention.PoisonArchive)},
	}}
	cmdMCP = &Command{Name: "mcp", Summary: "serve the application's agent tools over MCP on stdin/stdout, for a host that starts it as a subprocess",
		Long: `Logs go to stderr; stdout carries only MCP. The idempotency key of a call
comes from the request's _meta "dev.ferry/idempotency-key", set by the
host. The same tools are served over streamable HTTP at /mcp on the API
server (the run command), and as plain JSON at POST /tools/{name}.`,
		Flags: mcpFlags}
	cmdShadow = &Command{Name: "shadow", Summary: "shadow mode (adopting Ferry in a running service): compare intents with legacy effects", Sub: []*Command{
		{Name: "report", Summary: "per topic: shadow intents vs legacy effects, matched, and the aggregates missing on each side; exits 1 on a mismatch",
			Flags: shadowReportFlags},
	}}
	cmdBackfill = &Command{Name: "backfill", Summary: "write intents for existing rows the legacy system never handled: a dry run unless --apply, capped by --max, spread over time, resumable",
		Long: `The query (run in a READ ONLY transaction) returns aggregate_id, payload
(json, jsonb or JSON text) and optionally headers (a JSON object of strings),
one row per aggregate. Without --apply nothing is written: the dry run says
how many intents would be written, shows three, how many an earlier run of
the same --name wrote, and the schedule. Re-running the same --name writes
no intent twice; an interrupted run continues where it stopped.`,
		Flags: backfillFlags}
	cmdCDC = &Command{Name: "cdc", Summary: "the CDC relay's replication slot and publication", Sub: []*Command{
		{Name: "drop", Summary: "remove the slot and the publication (switching CDC off for good: a slot nobody streams retains WAL)", Flags: cdcDropFlags},
	}}
	cmdFind = &Command{Name: "find", Args: "ID", Summary: "where is this message? a message, aggregate (order) or correlation id looked up in the outbox, retries, held partitions, parked events (a tenant fleet), ledger and poison store: where it is now and what happened to it",
		Flags: findFlags}
	cmdPause = &Command{Name: "pause", Args: "ROUTE", Summary: "pause a handler (every partition and worker of the route) during an incident: its messages wait at the broker, in order, until resume; audited",
		Flags: pauseFlags}
	cmdResume = &Command{Name: "resume", Args: "ROUTE", Summary: "resume a paused handler; audited", Flags: resumeFlags}
	cmdHeld   = &Command{Name: "held", Summary: "the ordered partitions held behind a failing head", Sub: []*Command{
		{Name: "list", Summary: "the held partitions: head, held for, next attempt, last error", Flags: heldListFlags},
		{Name: "retry-now", Args: "[PARTITION]", Summary: "ask one held partition (or, with --route, every held partition of a route) to try its head again now instead of waiting out its backoff; audited", Flags: heldRetryFlags},
	}}
	cmdTenants = &Command{Name: "tenants", Summary: "the tenant registry of a fleet serving many tenant databases (FERRY_TENANTS): list, status, add, pause, limit, remove, migrate; audited", Sub: []*Command{
		{Name: "list", Summary: "the registered tenants: served or paused (by whom, why), limits, where each outbox is (passwords left out)", Flags: tenantsListFlags},
		{Name: "status", Summary: "per tenant: which fleet member serves it, pending and due events, the oldest due, failing rows, poisoned messages; exits 3 when one needs a human", Flags: tenantsStatusFlags},
		{Name: "add", Args: "ID", Summary: "migrate a tenant's database and schema, then register it: the fleet serves it within FERRY_TENANTS_RELOAD, no restart", Flags: tenantsAddFlags},
		{Name: "remove", Args: "ID", Summary: "unregister a tenant: the fleet stops serving it; its events still at the broker go to the poison store with the reason; its database is left as it is", Flags: tenantsRemoveFlags},
		{Name: "pause", Args: "ID", Summary: "stop relaying a tenant's outbox (its events wait there, in order) until resume", Flags: tenantsPauseFlags},
		{Name: "resume", Args: "ID", Summary: "relay a paused tenant's outbox again", Flags: tenantsResumeFlags},
		{Name: "limit", Args: "ID", Summary: "set a tenant's relay rate (events/s) and handler bound per process; 0 lifts either", Flags: tenantsLimitFlags},
		{Name: "migrate", Summary: "apply pending migrations (Ferry's, then the application's) to every tenant, or --tenant ID, and print each tenant's versions", Flags: tenantsMigrateFlags},
	}}
	cmdAudit       = &Command{Name: "audit", Summary: "the audit log: who requeued, retried or discarded what, when, how many, with the ids (console and CLI)", Flags: auditFlags}
	cmdHealthcheck = &Command{Name: "healthcheck", Summary: "exit 0 if the admin server's /readyz (or --url) answers 200; for container healthchecks, the image having no shell or curl",
		Flags: healthcheckFlags}
)

// OpenPool connects to the configured database and schema (no broker
// needed), and checks that Ferry's migrations are applied there.
func OpenPool(ctx context.Context, name string) (*pgxpool.Pool, error) {
	_, pool, err := openMigrated(ctx, name)
	return pool, err
}

// ErrNotMigrated says the configured schema lacks Ferry's tables.
var ErrNotMigrated = errors.New("not migrated")

// openMigrated is openConfigured for the commands that read Ferry's
// tables: on a schema that lacks them (never migrated, or the wrong
// FERRY_DATABASE_SCHEMA) it fails with one line that says what to do,
// before printing anything, instead of a driver's "relation does not
// exist" halfway through.
func openMigrated(ctx context.Context, name string) (app.Config, *pgxpool.Pool, error) {
	cfg, pool, err := openConfigured(ctx, name)
	if err != nil {
		return cfg, pool, err
	}
	missing, err := missingTables(ctx, pool, cfg.Relay.Table)
	if err == nil && len(missing) == 0 {
		return cfg, pool, nil
	}
	pool.Close()
	schema := cfg.DatabaseSchema
	if schema == "" {
		schema = "public"
	}
	if err != nil {
		return cfg, nil, fmt.Errorf("checking for Ferry's tables in schema %q: %w", schema, err)
	}
	return cfg, nil, fmt.Errorf("%w: schema %q has no %s; run `%s migrate up` with the FERRY_DATABASE_URL and FERRY_DATABASE_SCHEMA of your service (is FERRY_DATABASE_SCHEMA the one it uses?)",
		ErrNotMigrated, schema, strings.Join(missing, ", "), binaryName)
}

// missingTables are the tables of migrations.ReadTables the schema lacks,
// the outbox by its configured name (FERRY_OUTBOX_TABLE).
func missingTables(ctx context.Context, pool *pgxpool.Pool, outbox pgoutbox.Table) ([]string, error) {
	others := slices.DeleteFunc(slices.Clone(migrations.ReadTables), func(t string) bool { return t == pgoutbox.DefaultTable })
	missing, err := migrations.MissingTables(ctx, pool, others)
	if err != nil {
		return nil, err
	}
	var found bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, outbox.Quoted()).Scan(&found); err != nil {
		return nil, err
	}
	if !found {
		missing = append([]string{outbox.Name()}, missing...)
	}
	return missing, nil
}

// openConfigured loads the configuration and connects with it, for the
// commands that need both.
func openConfigured(ctx context.Context, name string) (app.Config, *pgxpool.Pool, error) {
	cfg, err := LoadConfig()
	if err != nil {
		return cfg, nil, err
	}
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: cfg.DatabaseURL, Schema: cfg.DatabaseSchema, ApplicationName: "ferry-" + name, MaxConns: 2})
	return cfg, pool, err
}

// outboxConfig is the outbox a command writes through (a requeue, a
// backfill): the configured table and bound on delays. Its ordered topics
// are the application's, which a command does not load: the relay keeps
// their order when it sends the rows.
func outboxConfig(cfg app.Config) pgoutbox.Config {
	return pgoutbox.Config{Table: cfg.Relay.Table, MaxDelay: cfg.MaxDelay}
}

// WriteJSON writes v indented, for --json output.
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
