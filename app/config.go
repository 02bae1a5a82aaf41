package app

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/adoption/cutoff"
	"github.com/ferry-dev/ferry/agenttools/mcptools"
	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgconfirm"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/tenancy"
)

// Relay modes (Config.RelayMode).
const (
	RelayModeNotify = "notify"
	RelayModePoll   = "poll"
	RelayModeCDC    = "cdc"
)

// Defaults of Config not owned by a component package.
const (
	DefaultDatabaseURL     = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	DefaultHTTPAddr        = "127.0.0.1:8080"
	DefaultAdminAddr       = "127.0.0.1:9091"
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultDatabaseMaxConns leaves room for every default consumer's
	// ledger transaction, the relay and its listener.
	DefaultDatabaseMaxConns = 24
	DefaultLogLevel         = "info"
	DefaultLogFormat        = "auto"
)

// Config is the whole application's configuration. Load it with
// ConfigFromEnv; every field has an environment variable (see EnvVars).
type Config struct {
	// DatabaseURL is the PostgreSQL URL. FERRY_DATABASE_URL.
	DatabaseURL string
	// DatabaseSchema puts Ferry's tables in this schema (search_path). FERRY_DATABASE_SCHEMA.
	DatabaseSchema string
	// DatabaseAppName is the application_name of Ferry's sessions. FERRY_DATABASE_APP_NAME.
	DatabaseAppName string
	// DatabaseMaxConns is the pool size. FERRY_DATABASE_MAX_CONNS.
	DatabaseMaxConns int32
	// AMQP configures RabbitMQ. FERRY_AMQP_*.
	AMQP rabbit.Config
	// Relay configures the outbox relay. FERRY_RELAY_*.
	Relay pgoutbox.RelayConfig
	// RelayMode is how the relay learns of committed events: "notify"
	// (LISTEN/NOTIFY, polling as the fallback), "poll" (polling only) or
	// "cdc" (streamed from the WAL, the polling relay as a slow safety
	// net). Default "notify". FERRY_RELAY_MODE, or `ferry relay --mode`.
	RelayMode string
	// CDC configures the CDC relay (RelayMode "cdc"). FERRY_CDC_*.
	CDC pgcdc.Config
	// Tenants turns on the tenant fleet: besides its own database (the
	// control database, where the registry, the poison store and the
	// audit log are), the process relays and consumes the outboxes of the
	// tenants in the registry (pgtenants, `ferry tenants`), each in its
	// own database. FERRY_TENANTS; default false.
	Tenants bool
	// Fleet configures the tenant fleet (Tenants). Its Relay is Relay; the
	// app sets the rest of what it wires. FERRY_TENANTS_*, FERRY_TENANT_*.
	Fleet tenancy.Config
	// CDCSafetyNetInterval and CDCSafetyNetMinAge are the polling relay's
	// poll interval and minimum row age in CDC mode. Defaults 5s and 10s.
	// FERRY_CDC_SAFETY_NET_INTERVAL, FERRY_CDC_SAFETY_NET_MIN_AGE.
	CDCSafetyNetInterval, CDCSafetyNetMinAge time.Duration
	// Retry configures the consumers' in-process retries. FERRY_RETRY_*.
	Retry middleware.RetryConfig
	// DurableRetry configures the consumers' delayed retries (its Scheduler
	// is wired by the app). FERRY_DURABLE_RETRY_*.
	DurableRetry middleware.DurableRetryConfig
	// Retention configures pruning of the outbox and the ledger. FERRY_*_RETENTION, FERRY_PRUNE_*.
	Retention RetentionConfig
	// AdminAddr is where /metrics, /healthz, /readyz and /admin/* listen;
	// "off" turns the admin server off. FERRY_ADMIN_ADDR.
	AdminAddr string
	// AdminToken guards the admin endpoints that change state (Bearer
	// token); without one they refuse. FERRY_ADMIN_TOKEN.
	AdminToken string
	// ConsoleIdentityHeader names the request header an authenticating
	// proxy in front of the console sets to who the user is: the console
	// records it with each login, and the audit log names it.
	// FERRY_CONSOLE_IDENTITY_HEADER; empty: none (set it only behind such
	// a proxy, which must also strip it from clients' requests).
	ConsoleIdentityHeader string
	// ConsoleOpenReads lets requests from loopback read the console without
	// logging in. FERRY_CONSOLE_OPEN_READS; default false: a reverse proxy
	// or a tunnel on the host makes every request look local, and the
	// console shows payloads and failure reasons.
	ConsoleOpenReads bool
	// ConsoleTrustedProxies are the reverse proxies in front of the
	// console, whose X-Forwarded-For and X-Forwarded-Proto it believes.
	// FERRY_CONSOLE_TRUSTED_PROXIES (addresses or CIDRs, comma-separated);
	// default none: the peer is the client.
	ConsoleTrustedProxies []netip.Prefix
	// ConsoleSecureCookies marks the session cookie Secure whatever the
	// request says, for TLS ended by a proxy that sends no
	// X-Forwarded-Proto. FERRY_CONSOLE_SECURE_COOKIES; default false.
	ConsoleSecureCookies bool
	// ConsoleIdleTimeout ends a console session unused this long.
	// FERRY_CONSOLE_IDLE_TIMEOUT; default 30m.
	ConsoleIdleTimeout time.Duration
	// ConsoleMaskFields are payload fields the console's pages show as
	// "<masked>". FERRY_CONSOLE_MASK_FIELDS (comma-separated JSON keys).
	ConsoleMaskFields []string
	// ConsoleConfirmTTL is how long a console confirmation can be acted
	// on (it binds the ids it counted). FERRY_CONSOLE_CONFIRM_TTL; default
	// 10m.
	ConsoleConfirmTTL time.Duration
	// MetricsRefresh is how often the outbox gauges are recomputed. FERRY_METRICS_REFRESH.
	MetricsRefresh time.Duration
	// HTTPAddr is where the application's HTTP API (Options.HTTP) listens.
	// FERRY_HTTP_ADDR.
	HTTPAddr string
	// HTTPServer bounds what one client can hold of the HTTP API and the
	// admin server. FERRY_HTTP_*.
	HTTPServer HTTPServerConfig
	// Cutoff says which aggregates go through the outbox while a service
	// adopts Ferry (App.Cutoff). FERRY_CUTOFF, FERRY_CUTOFF_TOPICS.
	Cutoff cutoff.Config
	// MCPToken, if set, is the Bearer token the agent tool endpoints (/mcp,
	// /tools) on the API server require. FERRY_MCP_TOKEN.
	MCPToken string
	// MCPSessionTimeout closes an MCP session idle this long. Default 30m.
	// FERRY_MCP_SESSION_TIMEOUT.
	MCPSessionTimeout time.Duration
	// MCPMaxSessions caps the MCP sessions open at once. Default 1000.
	// FERRY_MCP_MAX_SESSIONS.
	MCPMaxSessions int
	// ShutdownTimeout bounds a graceful stop: consumers drain for up to
	// this long (the handlers finish and ack what they hold), servers
	// finish their requests. FERRY_SHUTDOWN_TIMEOUT.
	ShutdownTimeout time.Duration
	// Ledger configures the consumers' ledger: how long a delivery waits
	// on a silent transaction holding its message's ledger row
	// (FERRY_LEDGER_TAKEOVER_AFTER; pgledger.Config.TakeOverAfter).
	Ledger pgledger.Config
	// MaxDelay bounds how far ahead a producer's event may ask to be
	// delivered (pipeline.WithDelay, WithDeliverAt). Default a year.
	// FERRY_MAX_DELAY.
	MaxDelay time.Duration
	// LogLevel is debug, info, warn or error. FERRY_LOG_LEVEL.
	LogLevel string
	// LogFormat is json, text or auto (text on a terminal). FERRY_LOG_FORMAT.
	LogFormat string
}

// Defaults of HTTPServerConfig.
const (
	DefaultHTTPReadHeaderTimeout = 5 * time.Second
	DefaultHTTPReadTimeout       = 30 * time.Second
	DefaultHTTPWriteTimeout      = 30 * time.Second
	DefaultHTTPIdleTimeout       = 2 * time.Minute
	DefaultHTTPMaxHeaderBytes    = 64 << 10
	DefaultHTTPMaxConns          = 1024
	DefaultHTTPMaxConnsPerClient = 64
	DefaultHTTPMinBodyRate       = 8 << 10
	// MinAdminTokenLength keeps the admin token out of guessing range.
	MinAdminTokenLength = 16
)

// HTTPServerConfig bounds the HTTP servers (API and admin) against slow
// and idle clients: without these a slow body or an idle keep-alive holds
// a connection, and a goroutine, for as long as the client likes.
type HTTPServerConfig struct {
	// ReadHeaderTimeout bounds reading a request's headers. Default 5s.
	ReadHeaderTimeout time.Duration
	// ReadTimeout bounds reading a whole request, body included. Default 30s.
	ReadTimeout time.Duration
	// WriteTimeout bounds writing a response, from the end of the request's
	// headers. Default 30s.
	WriteTimeout time.Duration
	// IdleTimeout closes a keep-alive connection idle this long. Default 2m.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's headers. Default 64 KiB.
	MaxHeaderBytes int
	// MaxConns caps the connections one server holds at once. At the cap
	// a newcomer takes the slot of the connection that has waited longest
	// without a request in progress (still to send its headers, or idle);
	// it waits only when every slot carries a request. Default 1024.
	MaxConns int
	// MaxConnsPerClient caps the connections of one client address, by the
	// same rule: a client's new connection takes the slot of its own
	// longest-waiting one. Default 64.
	MaxConnsPerClient int
	// MinBodyRate is the slowest a request's body may arrive, in bytes a
	// second, after ReadHeaderTimeout's grace: a body announced and not
	// sent is cut then, not at ReadTimeout. Default 8192; negative: off.
	MinBodyRate int
	// AllowedHosts are the Host names (without port) the servers answer;
	// "*" answers any. Others get 421: a defence against DNS rebinding.
	// Default: on a server bound to loopback, localhost, 127.0.0.1, ::1;
	// on one bound beyond loopback, any (set it there to the public names).
	AllowedHosts []string
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c HTTPServerConfig) WithDefaults() HTTPServerConfig {
	c.ReadHeaderTimeout = cmp.Or(c.ReadHeaderTimeout, DefaultHTTPReadHeaderTimeout)
	c.ReadTimeout = cmp.Or(c.ReadTimeout, DefaultHTTPReadTimeout)
	c.WriteTimeout = cmp.Or(c.WriteTimeout, DefaultHTTPWriteTimeout)
	c.IdleTimeout = cmp.Or(c.IdleTimeout, DefaultHTTPIdleTimeout)
	c.MaxHeaderBytes = cmp.Or(c.MaxHeaderBytes, DefaultHTTPMaxHeaderBytes)
	c.MaxConns = cmp.Or(c.MaxConns, DefaultHTTPMaxConns)
	c.MaxConnsPerClient = cmp.Or(c.MaxConnsPerClient, DefaultHTTPMaxConnsPerClient)
	c.MinBodyRate = cmp.Or(c.MinBodyRate, DefaultHTTPMinBodyRate)
	return c
}

// RetentionConfig says how long Ferry keeps what it keeps only for a while.
type RetentionConfig struct {
	// Outbox is how long dispatched outbox rows are kept. Default 720h (30 days).
	Outbox time.Duration
	// Ledger is how long the consumers' ledger remembers a message. It must
	// outlast any redelivery: a message redelivered after its row is pruned
	// runs again. Default 336h (14 days).
	Ledger time.Duration
	// ToolCalls is how long agent tool call records are kept: a host
	// retrying a call after that runs it again. Default 336h (14 days).
	ToolCalls time.Duration
	// PoisonArchive is how long discarded poison messages are kept in
	// ferry_poison_archive, where a discard can be undone. Default 336h
	// (14 days).
	PoisonArchive time.Duration
	// ArchiveOutbox moves pruned outbox rows into outbox_archive. Default false.
	ArchiveOutbox bool
	// Interval is how often `ferry run` prunes. Default 1h.
	Interval time.Duration
	// BatchSize is how many rows one pruning transaction removes. Default 10,000.
	BatchSize int
}

// EnvVar documents one environment variable. Applications list their own
// variables in the same shape (without a setter) so that `ferry help config`
// and docs/configuration.md show them beside Ferry's.
type EnvVar struct {
	// Name is the variable ("FERRY_DATABASE_URL").
	Name string
	// Default is what applies when the variable is unset, as shown to
	// people ("127.0.0.1:8080", or "(none)" with what that means).
	Default string
	// Doc says in one line what it sets; `help config` and
	// docs/configuration.md show it.
	Doc string
	set func(c *Config, v string) error
}

// EnvVars lists every variable ConfigFromEnv reads, with its default;
// `ferry help config` prints this list and docs/configuration.md is
// generated from it (TestConfigurationReference keeps them equal).
func EnvVars() []EnvVar {
	return []EnvVar{
		{"FERRY_DATABASE_URL", DefaultDatabaseURL, "PostgreSQL URL", func(c *Config, v string) error { c.DatabaseURL = v; return nil }},
		{"FERRY_DATABASE_SCHEMA", "(search_path of the URL)", "schema for Ferry's tables", func(c *Config, v string) error { c.DatabaseSchema = v; return nil }},
		{"FERRY_DATABASE_MAX_CONNS", strconv.Itoa(DefaultDatabaseMaxConns), "database pool size (each busy consumer holds one)", func(c *Config, v string) error {
			n, err := boundedInt(v, 2, 10_000)
			c.DatabaseMaxConns = int32(n)
			return err
		}},
		{"FERRY_DATABASE_APP_NAME", "ferry", "application_name of Ferry's database sessions", func(c *Config, v string) error { c.DatabaseAppName = v; return nil }},
		{"FERRY_AMQP_URL", rabbit.DefaultURL, "RabbitMQ URL, vhost included; a cluster's nodes comma-separated (each connection fails over to the next)", func(c *Config, v string) error { c.AMQP.URL = v; return nil }},
		{"FERRY_AMQP_NAMESPACE", "(none)", "prefix of every exchange and queue name", func(c *Config, v string) error { c.AMQP.Namespace = v; return nil }},
		{"FERRY_AMQP_QUEUE_TYPE", rabbit.QueueTypeQuorum, "quorum or classic", func(c *Config, v string) error { c.AMQP.QueueType = v; return nil }},
		{"FERRY_AMQP_PREFETCH", strconv.Itoa(rabbit.DefaultPrefetch), "unacked messages per consumer", intVar(func(c *Config) *int { return &c.AMQP.Prefetch }, 1, 65535)},
		{"FERRY_AMQP_HEARTBEAT", rabbit.DefaultHeartbeat.String(), "AMQP heartbeat timeout: bounds how long a connection behind a black hole goes unnoticed (the broker hands a silent consumer's deliveries and ordered partitions to the others after about two timeouts)", durationVar(func(c *Config) *time.Duration { return &c.AMQP.Heartbeat })},
		{"FERRY_AMQP_PUBLISH_CHANNELS", strconv.Itoa(rabbit.DefaultPublishChannels), "publisher channel pool size", intVar(func(c *Config) *int { return &c.AMQP.PublishChannels }, 1, 1024)},
		{"FERRY_AMQP_CONSUMERS", strconv.Itoa(rabbit.DefaultConsumers), "consumers per queue of an unordered handler", intVar(func(c *Config) *int { return &c.AMQP.Consumers }, 1, rabbit.MaxConsumers)},
		{"FERRY_AMQP_BACKLOG_CONSUMERS", "FERRY_AMQP_CONSUMERS / 4, at least 1", "tenant fleet: consumers per backlog lane of an unordered handler (fewer, so that a backlog drains with the machine left to new events)", intVar(func(c *Config) *int { return &c.AMQP.BacklogConsumers }, 1, rabbit.MaxConsumers)},
		{"FERRY_AMQP_PARTITIONS", strconv.Itoa(rabbit.DefaultPartitions), "partition queues per handler of an ordered topic (drain before changing)", intVar(func(c *Config) *int { return &c.AMQP.Partitions }, 1, rabbit.MaxPartitions)},
		{"FERRY_ORDERED_TOPICS", "(routes marked Ordered)", "more topics kept in per-aggregate order, comma-separated", func(c *Config, v string) error {
			c.AMQP.OrderedTopics = append(c.AMQP.OrderedTopics, pipeline.SplitList(v)...)
			return nil
		}},
		{"FERRY_SHADOW_TOPICS", "(none)", "topics in shadow mode: the relay marks their intents dispatched without publishing, comma-separated", func(c *Config, v string) error {
			c.Relay.ShadowTopics = append(c.Relay.ShadowTopics, pipeline.SplitList(v)...)
			return nil
		}},
		{"FERRY_CUTOFF", "(none: every aggregate through the outbox)", "cut-off (RFC 3339) of topics without their own: older aggregates stay on the legacy path (App.Cutoff)", func(c *Config, v string) error {
			t, err := time.Parse(time.RFC3339, v)
			if err != nil {
				return errors.New("must be an RFC 3339 time, like 2026-12-01T00:00:00Z")
			}
			c.Cutoff.Default = t
			return nil
		}},
		{"FERRY_CUTOFF_TOPICS", "(none)", "cut-offs per topic: topic=RFC 3339 time, comma-separated", func(c *Config, v string) error {
			m, err := cutoff.ParseTopics(v)
			c.Cutoff.Topics = m
			return err
		}},
		{"FERRY_RELAY_BATCH_SIZE", strconv.Itoa(pgoutbox.DefaultRelayBatchSize), "rows per relay claim", intVar(func(c *Config) *int { return &c.Relay.BatchSize }, 1, pgoutbox.MaxRelayBatchSize)},
		{"FERRY_RELAY_CATCH_UP_BATCH_SIZE", strconv.Itoa(pgoutbox.DefaultRelayCatchUpBatchSize) + " (FERRY_RELAY_BATCH_SIZE when larger)", "rows per page of new rows while the relay is behind (after a full page; fewer when payloads are large)", intVar(func(c *Config) *int { return &c.Relay.CatchUpBatchSize }, 1, pgoutbox.MaxRelayBatchSize)},
		{"FERRY_RELAY_IN_FLIGHT", strconv.Itoa(pgoutbox.DefaultRelayInFlight), "batches one relay has in flight at once: one of all relays moves the position, the others work the slow lane (failed, delayed, held rows)", intVar(func(c *Config) *int { return &c.Relay.InFlight }, 1, pgoutbox.MaxRelayInFlight)},
		{"FERRY_RELAY_POLL_INTERVAL", pgoutbox.DefaultRelayPollInterval.String(), "relay sleep when nothing is due", durationVar(func(c *Config) *time.Duration { return &c.Relay.PollInterval })},
		{"FERRY_RELAY_PROBE_INTERVAL", pgoutbox.DefaultRelayProbeInterval.String(), "busy relay (work within 2 s) with nothing due: how often it probes for commits nobody announced (another program's INSERT, a pool Ferry does not watch); off: wake-ups and the poll only", func(c *Config, v string) error {
			if v == "off" {
				c.Relay.ProbeInterval = -1
				return nil
			}
			return durationVar(func(c *Config) *time.Duration { return &c.Relay.ProbeInterval })(c, v)
		}},
		{"FERRY_RELAY_IDLE_PROBE_INTERVAL", pgoutbox.DefaultRelayIdleProbeInterval.String(), "idle relay: the probes space out up to this, the longest a commit nobody announced waits after a silence (announced ones wake the relay at once)", durationVar(func(c *Config) *time.Duration { return &c.Relay.IdleProbeInterval })},
		{"FERRY_RELAY_FAILOVER_REPLAY", pgoutbox.DefaultFailoverReplay.String(), "after a failover (the database on a newer timeline), the relay sends again the events dispatched this long before the last dispatch the new primary knows; the consumers' ledger drops those already done (an asynchronous standby can lack their last ledger commits); off: never", func(c *Config, v string) error {
			if v == "off" {
				c.Relay.FailoverReplay = -1
				return nil
			}
			return durationVar(func(c *Config) *time.Duration { return &c.Relay.FailoverReplay })(c, v)
		}},
		{"FERRY_RELAY_CONFIRM_TIMEOUT", pgoutbox.DefaultRelayConfirmTimeout.String(), "how long a relay batch waits for the broker's confirms; past it (a broker behind a black hole) the messages count as the relay's outage, not the rows': no attempt spent, other relays send them; with 2s more, it bounds how long the database keeps a batch's transaction idle (a relay whose database link went silent releases the position then)", durationVar(func(c *Config) *time.Duration { return &c.Relay.ConfirmTimeout })},
		{"FERRY_RELAY_MODE", RelayModeNotify, "notify (producers wake the relays after their commits; LISTEN, polling as the fallback), poll (polling only) or cdc (stream from the WAL; see CDC relay mode)", func(c *Config, v string) error { c.RelayMode = v; return nil }},
		{"FERRY_TENANTS", "false", "true serves the tenants in the registry (ferry tenants) besides this database, each in its own database and schema: see docs/tenants.md", func(c *Config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return errors.New("must be true or false")
			}
			c.Tenants = b
			return nil
		}},
		{"FERRY_TENANTS_WORKERS", strconv.Itoa(tenancy.DefaultWorkers), "tenant fleet: tenants' relay batches at once (a tenant's backlog takes one at a time, then goes to the end of the line)", intVar(func(c *Config) *int { return &c.Fleet.Workers }, 1, 256)},
		{"FERRY_TENANTS_RELOAD", tenancy.DefaultReload.String(), "tenant fleet: how often the registry and the fleet's members are read again (tenants added, paused, removed; a member gone)", durationVar(func(c *Config) *time.Duration { return &c.Fleet.Reload })},
		{"FERRY_TENANTS_SWEEP", tenancy.DefaultSweep.String(), "tenant fleet: each tenant's outbox is claimed at least this often (commits nobody announced; announced ones wake it at once)", durationVar(func(c *Config) *time.Duration { return &c.Fleet.Sweep })},
		{"FERRY_TENANTS_BACKLOG_ROOM", strconv.Itoa(tenancy.DefaultBacklogRoom), "tenant fleet: a tenant with a backlog (its last batch full) sends its next batch, on the routes' backlog lanes, only while the lanes and the ordered topics' partitions hold fewer ready messages than this; off: backlogs never wait", func(c *Config, v string) error {
			if v == "off" {
				c.Fleet.BacklogRoom = -1
				return nil
			}
			n, err := boundedInt(v, 1, 1_000_000)
			c.Fleet.BacklogRoom = n
			return err
		}},
		{"FERRY_TENANTS_BACKLOG_SLOWDOWN", strconv.FormatFloat(tenancy.DefaultBacklogSlowdown, 'g', -1, 64), "tenant fleet: how much slower other tenants' new events may get beside a backlog before its batches are spaced out more (lower: their latency kept; higher: a backlog drains sooner); off: as fast as the room lets it", func(c *Config, v string) error {
			if v == "off" {
				c.Fleet.BacklogSlowdown = -1
				return nil
			}
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f < 1 || f > 100 {
				return errors.New("must be a number in [1, 100], or off")
			}
			c.Fleet.BacklogSlowdown = f
			return nil
		}},
		{"FERRY_TENANT_MAX_CONNS", strconv.Itoa(tenancy.DefaultTenantMaxConns), "tenant fleet: connections one process opens to one tenant database at most, shared by the tenants whose schemas are in it", func(c *Config, v string) error {
			n, err := boundedInt(v, 1, 1000)
			c.Fleet.Pools.MaxConns = int32(n)
			return err
		}},
		{"FERRY_TENANTS_CONN_BUDGET", strconv.Itoa(tenancy.DefaultTenantConnBudget), "tenant fleet: connections this process holds to all tenant databases together; past it the idle ones of the database used least recently close first", intVar(func(c *Config) *int { return &c.Fleet.Pools.Budget }, 1, 100_000)},
		{"FERRY_TENANT_IDLE_AFTER", tenancy.DefaultTenantIdleAfter.String(), "tenant fleet: a connection to a tenant database idle this long is closed (a database whose tenants are idle holds none)", durationVar(func(c *Config) *time.Duration { return &c.Fleet.Pools.IdleAfter })},
		{"FERRY_CDC_SLOT", "ferry_<database>_<schema>", "CDC: logical replication slot (a-z, 0-9, _; cluster-wide)", func(c *Config, v string) error { c.CDC.Slot = v; return pgcdc.ValidateName(v) }},
		{"FERRY_CDC_PUBLICATION", "(the slot's name)", "CDC: publication on the outbox table (inserts only)", func(c *Config, v string) error { c.CDC.Publication = v; return pgcdc.ValidateName(v) }},
		{"FERRY_CDC_BATCH_SIZE", strconv.Itoa(pgcdc.DefaultBatchSize), "CDC: outbox rows per publish batch", intVar(func(c *Config) *int { return &c.CDC.BatchSize }, 1, pgcdc.MaxBatchSize)},
		{"FERRY_CDC_IN_FLIGHT", strconv.Itoa(pgcdc.DefaultInFlight), "CDC: publish batches at once (never two of one ordered aggregate)", intVar(func(c *Config) *int { return &c.CDC.InFlight }, 1, pgcdc.MaxInFlight)},
		{"FERRY_CDC_HEARTBEAT_INTERVAL", pgcdc.DefaultHeartbeatInterval.String(), "CDC: idle time before a heartbeat moves the slot past unrelated WAL", durationVar(func(c *Config) *time.Duration { return &c.CDC.HeartbeatInterval })},
		{"FERRY_CDC_SAFETY_NET_INTERVAL", pgcdc.DefaultSafetyNetInterval.String(), "CDC: poll interval of the polling relay kept as the safety net", durationVar(func(c *Config) *time.Duration { return &c.CDCSafetyNetInterval })},
		{"FERRY_CDC_SAFETY_NET_MIN_AGE", pgcdc.DefaultSafetyNetMinAge.String(), "CDC: the safety net takes only rows at least this old (the stream's are younger)", durationVar(func(c *Config) *time.Duration { return &c.CDCSafetyNetMinAge })},
		{"FERRY_RELAY_BACKOFF_INITIAL", "30s", "relay retry delay after the first failure", durationVar(func(c *Config) *time.Duration { return &c.Relay.Backoff.Initial })},
		{"FERRY_RELAY_BACKOFF_MAX", "15m", "relay retry delay cap", durationVar(func(c *Config) *time.Duration { return &c.Relay.Backoff.Max })},
		{"FERRY_RETRY_MAX", strconv.Itoa(middleware.DefaultRetryMaxRetries), "in-process handler retries before a durable retry (0: none)", func(c *Config, v string) error {
			n, err := boundedInt(v, -1, 100)
			if err != nil {
				return err
			}
			if n == 0 {
				n = -1 // RetryConfig's "none": its zero means the default
			}
			c.Retry.MaxRetries = n
			return nil
		}},
		{"FERRY_RETRY_INITIAL_INTERVAL", middleware.DefaultRetryInitialInterval.String(), "wait before the first handler retry", durationVar(func(c *Config) *time.Duration { return &c.Retry.InitialInterval })},
		{"FERRY_RETRY_MAX_INTERVAL", middleware.DefaultRetryMaxInterval.String(), "cap of the wait between handler retries", durationVar(func(c *Config) *time.Duration { return &c.Retry.MaxInterval })},
		{"FERRY_DURABLE_RETRY_MAX_ATTEMPTS", strconv.Itoa(middleware.DefaultDurableRetryMaxAttempts), "deliveries of a failing message (first included) before the poison store", intVar(func(c *Config) *int { return &c.DurableRetry.MaxAttempts }, 1, 1000)},
		{"FERRY_DURABLE_RETRY_INITIAL", "30s", "delay before the first durable retry", durationVar(func(c *Config) *time.Duration { return &c.DurableRetry.Backoff.Initial })},
		{"FERRY_DURABLE_RETRY_MAX", "15m", "cap of the durable retry delay (it doubles, 20% jitter)", durationVar(func(c *Config) *time.Duration { return &c.DurableRetry.Backoff.Max })},
		{"FERRY_OUTBOX_TABLE", pgoutbox.DefaultTable, "the outbox table (table or schema.table) that the publisher writes and the relay, status, the console and every command read; a table of another name is yours to create (docs/operations.md)", func(c *Config, v string) error {
			t, err := pgoutbox.ParseTable(v)
			c.Relay.Table = t
			return err
		}},
		{"FERRY_OUTBOX_RETENTION", "720h", "keep dispatched outbox rows this long (at most 2352h: rows go with their week's partition, once the whole week is past it)", durationVar(func(c *Config) *time.Duration { return &c.Retention.Outbox })},
		{"FERRY_LEDGER_RETENTION", "336h", "keep the consumers' ledger this long (must outlast redeliveries; at least 1h, at most 2352h: rows go with their week's partition, once the whole week is past it)", durationVar(func(c *Config) *time.Duration { return &c.Retention.Ledger })},
		{"FERRY_TOOL_CALL_RETENTION", "336h", "keep agent tool call records (idempotency) this long", durationVar(func(c *Config) *time.Duration { return &c.Retention.ToolCalls })},
		{"FERRY_POISON_ARCHIVE_RETENTION", "336h", "keep discarded poison messages this long (a discard can be undone until then)", durationVar(func(c *Config) *time.Duration { return &c.Retention.PoisonArchive })},
		{"FERRY_OUTBOX_ARCHIVE", "false", "move pruned outbox rows to outbox_archive", func(c *Config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return errors.New("must be true or false")
			}
			c.Retention.ArchiveOutbox = b
			return nil
		}},
		{"FERRY_PRUNE_INTERVAL", "1h", "how often `ferry run` prunes", durationVar(func(c *Config) *time.Duration { return &c.Retention.Interval })},
		{"FERRY_PRUNE_BATCH_SIZE", "10000", "rows per pruning transaction", intVar(func(c *Config) *int { return &c.Retention.BatchSize }, 1, 1_000_000)},
		{"FERRY_ADMIN_ADDR", DefaultAdminAddr, "admin server (/metrics, /healthz, /readyz, /admin/*); off to disable", func(c *Config, v string) error { c.AdminAddr = v; return nil }},
		{"FERRY_ADMIN_TOKEN", "(none: state-changing admin endpoints refuse)", "Bearer token of the state-changing admin endpoints (at least 16 characters)", func(c *Config, v string) error { c.AdminToken = v; return nil }},
		{"FERRY_CONSOLE_IDENTITY_HEADER", "(none)", "request header in which an authenticating proxy in front of the console passes the user's identity, recorded with each login and in the audit log", func(c *Config, v string) error {
			if v != "" && !validHeaderName(v) {
				return fmt.Errorf("%q is not an HTTP header name", v)
			}
			c.ConsoleIdentityHeader = v
			return nil
		}},
		{"FERRY_CONSOLE_OPEN_READS", "false", "true lets requests from loopback read the console without logging in (only where nothing on the host forwards requests: a proxy or a tunnel looks like loopback); actions need FERRY_ADMIN_TOKEN either way", func(c *Config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return errors.New("must be true or false")
			}
			c.ConsoleOpenReads = b
			return nil
		}},
		{"FERRY_CONSOLE_TRUSTED_PROXIES", "(none: the peer is the client)", "addresses or CIDRs of the reverse proxies in front of the console, comma-separated: their X-Forwarded-For names the client (failed-login limits, the audit log's address) and their X-Forwarded-Proto marks the session cookie Secure", func(c *Config, v string) error {
			c.ConsoleTrustedProxies = nil
			for _, part := range strings.Split(v, ",") {
				if part = strings.TrimSpace(part); part == "" {
					continue
				}
				p, err := netip.ParsePrefix(part)
				if err != nil {
					a, aerr := netip.ParseAddr(part)
					if aerr != nil {
						return fmt.Errorf("%q is neither an address nor a CIDR", part)
					}
					p = netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
				}
				c.ConsoleTrustedProxies = append(c.ConsoleTrustedProxies, p.Masked())
			}
			return nil
		}},
		{"FERRY_CONSOLE_SECURE_COOKIES", "false", "true marks the console's session cookie Secure whatever the request says (TLS ended by a proxy that sends no X-Forwarded-Proto)", func(c *Config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return errors.New("must be true or false")
			}
			c.ConsoleSecureCookies = b
			return nil
		}},
		{"FERRY_CONSOLE_IDLE_TIMEOUT", "30m0s", "a console session unused this long ends (a login lasts 12h at most)", durationVar(func(c *Config) *time.Duration { return &c.ConsoleIdleTimeout })},
		{"FERRY_CONSOLE_MASK_FIELDS", "(none)", "payload fields (JSON keys at any depth, comma-separated) the console's pages show as <masked>; a payload that is not JSON is then hidden whole", func(c *Config, v string) error {
			c.ConsoleMaskFields = nil
			for _, f := range strings.Split(v, ",") {
				if f = strings.TrimSpace(f); f != "" {
					c.ConsoleMaskFields = append(c.ConsoleMaskFields, f)
				}
			}
			return nil
		}},
		{"FERRY_CONSOLE_CONFIRM_TTL", pgconfirm.DefaultTTL.String(), "how long a console confirmation can be acted on: it binds the ids it counted, and later they may not be what the operator would choose", durationVar(func(c *Config) *time.Duration { return &c.ConsoleConfirmTTL })},
		{"FERRY_METRICS_REFRESH", "15s", "how often the outbox gauges are recomputed", durationVar(func(c *Config) *time.Duration { return &c.MetricsRefresh })},
		{"FERRY_HTTP_ADDR", DefaultHTTPAddr, "listen address of the application's HTTP API (Options.HTTP)", func(c *Config, v string) error { c.HTTPAddr = v; return nil }},
		{"FERRY_MCP_TOKEN", "(none: /mcp and /tools need no token; keep FERRY_HTTP_ADDR on loopback)", "Bearer token of the agent tool endpoints /mcp and /tools (at least 16 characters)", func(c *Config, v string) error { c.MCPToken = v; return nil }},
		{"FERRY_MCP_SESSION_TIMEOUT", mcptools.DefaultSessionTimeout.String(), "/mcp: close a session idle this long", durationVar(func(c *Config) *time.Duration { return &c.MCPSessionTimeout })},
		{"FERRY_MCP_MAX_SESSIONS", strconv.Itoa(mcptools.DefaultMaxSessions), "/mcp: sessions open at once; more are refused until some close", intVar(func(c *Config) *int { return &c.MCPMaxSessions }, 1, 1_000_000)},
		{"FERRY_HTTP_READ_HEADER_TIMEOUT", DefaultHTTPReadHeaderTimeout.String(), "API and admin servers: time to read a request's headers", durationVar(func(c *Config) *time.Duration { return &c.HTTPServer.ReadHeaderTimeout })},
		{"FERRY_HTTP_READ_TIMEOUT", DefaultHTTPReadTimeout.String(), "API and admin servers: time to read a whole request, body included", durationVar(func(c *Config) *time.Duration { return &c.HTTPServer.ReadTimeout })},
		{"FERRY_HTTP_WRITE_TIMEOUT", DefaultHTTPWriteTimeout.String(), "API and admin servers: time to write a response", durationVar(func(c *Config) *time.Duration { return &c.HTTPServer.WriteTimeout })},
		{"FERRY_HTTP_IDLE_TIMEOUT", DefaultHTTPIdleTimeout.String(), "API and admin servers: close keep-alive connections idle this long", durationVar(func(c *Config) *time.Duration { return &c.HTTPServer.IdleTimeout })},
		{"FERRY_HTTP_MAX_HEADER_BYTES", strconv.Itoa(DefaultHTTPMaxHeaderBytes), "API and admin servers: largest request header block", intVar(func(c *Config) *int { return &c.HTTPServer.MaxHeaderBytes }, 1024, 1<<20)},
		{"FERRY_HTTP_ALLOWED_HOSTS", "(loopback servers: localhost,127.0.0.1,::1; others: any)", "API and admin servers: Host names answered, comma-separated (* for any); others get 421 (DNS rebinding)", func(c *Config, v string) error {
			hosts, err := parseHosts(v)
			c.HTTPServer.AllowedHosts = hosts
			return err
		}},
		{"FERRY_HTTP_MAX_CONNS", strconv.Itoa(DefaultHTTPMaxConns), "API and admin servers: connections held at once, each; at the cap a newcomer takes the slot of the longest-waiting connection without a request in progress", intVar(func(c *Config) *int { return &c.HTTPServer.MaxConns }, 1, 1_000_000)},
		{"FERRY_HTTP_MAX_CONNS_PER_CLIENT", strconv.Itoa(DefaultHTTPMaxConnsPerClient), "API and admin servers: connections of one client address, by the same rule", intVar(func(c *Config) *int { return &c.HTTPServer.MaxConnsPerClient }, 1, 1_000_000)},
		{"FERRY_HTTP_MIN_BODY_RATE", strconv.Itoa(DefaultHTTPMinBodyRate), "API and admin servers: slowest request body accepted, bytes/s, after FERRY_HTTP_READ_HEADER_TIMEOUT's grace (-1: off)", intVar(func(c *Config) *int { return &c.HTTPServer.MinBodyRate }, -1, 1<<30)},
		{"FERRY_LEDGER_TAKEOVER_AFTER", pgledger.DefaultTakeOverAfter.String(), "a delivery waiting on another transaction that holds its message's ledger row and has sent the database nothing for this long (its process lost the database or hangs, its delivery came here) ends that transaction's session and runs the handler, its effects keyed by the message id; a busy holder is waited for; off: wait until the server drops the connection", func(c *Config, v string) error {
			if v == "off" {
				c.Ledger.TakeOverAfter = -1
				return nil
			}
			return durationVar(func(c *Config) *time.Duration { return &c.Ledger.TakeOverAfter })(c, v)
		}},
		{"FERRY_SHUTDOWN_TIMEOUT", DefaultShutdownTimeout.String(), "bound of a graceful stop: consumers drain (handlers finish and ack what they hold) for up to this long", durationVar(func(c *Config) *time.Duration { return &c.ShutdownTimeout })},
		{"FERRY_MAX_DELAY", pgoutbox.DefaultMaxDelay.String(), "furthest ahead an event may ask to be delivered (ferry_delay, ferry_deliver_at); later is refused at publish", durationVar(func(c *Config) *time.Duration { return &c.MaxDelay })},
		{"FERRY_LOG_LEVEL", DefaultLogLevel, "debug, info, warn or error", func(c *Config, v string) error { c.LogLevel = v; return nil }},
		{"FERRY_LOG_FORMAT", DefaultLogFormat, "json, text or auto (text on a terminal)", func(c *Config, v string) error { c.LogFormat = v; return nil }},
	}
}

// intVar sets an int field from a whole number in [lo, hi]. A value set
// is a value meant: 0 is refused where it is out of range, never taken as
// "use the default".
func intVar(field func(*Config) *int, lo, hi int) func(*Config, string) error {
	return func(c *Config, v string) error {
		n, err := boundedInt(v, lo, hi)
		if err != nil {
			return err
		}
		*field(c) = n
		return nil
	}
}

func boundedInt(v string, lo, hi int) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, errors.New("not a whole number")
	}
	if n < lo || n > hi {
		return 0, fmt.Errorf("must be in [%d, %d]", lo, hi)
	}
	return n, nil
}

// durationVar sets a duration field from a positive Go duration ("30s").
func durationVar(field func(*Config) *time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return errors.New(`not a duration (like "30s", "5m", "1h")`)
		}
		if d <= 0 {
			return errors.New("must be positive")
		}
		*field(c) = d
		return nil
	}
}

// ConfigFromEnv reads every FERRY_* variable (see EnvVars) over the
// defaults and validates the result, reporting every bad variable at once.
func ConfigFromEnv() (Config, error) {
	return ConfigFromLookup(os.LookupEnv)
}

// ConfigFromLookup is ConfigFromEnv with another source of variables.
func ConfigFromLookup(lookup func(string) (string, bool)) (Config, error) {
	var (
		c    Config
		errs []error
	)
	for _, ev := range EnvVars() {
		v, ok := lookup(ev.Name)
		if !ok || v == "" {
			continue
		}
		if err := ev.set(&c, strings.TrimSpace(v)); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: %w", ev.Name, v, err))
		}
	}
	c = c.WithDefaults()
	// Bad values and bad combinations are reported together: one run of the
	// binary should tell an operator everything to fix.
	errs = append(errs, c.Validate())
	return c, errors.Join(errs...)
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.DatabaseURL == "" {
		c.DatabaseURL = DefaultDatabaseURL
	}
	if c.DatabaseAppName == "" {
		c.DatabaseAppName = "ferry"
	}
	if c.DatabaseMaxConns == 0 {
		c.DatabaseMaxConns = DefaultDatabaseMaxConns
	}
	c.AMQP = c.AMQP.WithDefaults()
	c.Relay = c.Relay.WithDefaults()
	if c.RelayMode == "" {
		c.RelayMode = RelayModeNotify
	}
	c.CDC = c.CDC.WithDefaults()
	c.Fleet = c.Fleet.WithDefaults()
	if c.CDCSafetyNetInterval == 0 {
		c.CDCSafetyNetInterval = pgcdc.DefaultSafetyNetInterval
	}
	if c.CDCSafetyNetMinAge == 0 {
		c.CDCSafetyNetMinAge = pgcdc.DefaultSafetyNetMinAge
	}
	c.Retry = c.Retry.WithDefaults()
	if c.DurableRetry.MaxAttempts == 0 {
		c.DurableRetry.MaxAttempts = middleware.DefaultDurableRetryMaxAttempts
	}
	c.DurableRetry.Backoff = c.DurableRetry.Backoff.WithDefaults()
	if c.Retention.Outbox == 0 {
		c.Retention.Outbox = pgretention.DefaultOutboxRetention
	}
	if c.Retention.Ledger == 0 {
		c.Retention.Ledger = pgretention.DefaultLedgerRetention
	}
	if c.Retention.ToolCalls == 0 {
		c.Retention.ToolCalls = pgretention.DefaultToolCallRetention
	}
	if c.Retention.PoisonArchive == 0 {
		c.Retention.PoisonArchive = pgretention.DefaultPoisonArchiveRetention
	}
	if c.Retention.Interval == 0 {
		c.Retention.Interval = pgretention.DefaultInterval
	}
	if c.Retention.BatchSize == 0 {
		c.Retention.BatchSize = pgretention.DefaultBatchSize
	}
	if c.HTTPAddr == "" {
		c.HTTPAddr = DefaultHTTPAddr
	}
	c.HTTPServer = c.HTTPServer.WithDefaults()
	if c.AdminAddr == "" {
		c.AdminAddr = DefaultAdminAddr
	}
	if c.MetricsRefresh == 0 {
		c.MetricsRefresh = metrics.DefaultRefreshInterval
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.MaxDelay == 0 {
		c.MaxDelay = pgoutbox.DefaultMaxDelay
	}
	if c.LogLevel == "" {
		c.LogLevel = DefaultLogLevel
	}
	if c.LogFormat == "" {
		c.LogFormat = DefaultLogFormat
	}
	return c
}

// Validate reports every problem of c at once, naming the variable to fix.
func (c Config) Validate() error {
	var errs []error
	add := func(env string, err error) {
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", env, err))
		}
	}
	if !strings.HasPrefix(c.DatabaseURL, "postgres://") && !strings.HasPrefix(c.DatabaseURL, "postgresql://") {
		add("FERRY_DATABASE_URL", errors.New("must be a postgres:// URL"))
	} else if err := pipeline.ValidateConnectionURL(c.DatabaseURL); err != nil {
		add("FERRY_DATABASE_URL", fmt.Errorf("%s: %w", pipeline.RedactURL(c.DatabaseURL), err))
	}
	for _, n := range rabbit.Nodes(c.AMQP.URL) {
		if err := pipeline.ValidateConnectionURL(n); err != nil {
			add("FERRY_AMQP_URL", fmt.Errorf("%s: %w", pipeline.RedactURL(n), err))
		}
	}
	if c.DatabaseSchema != "" {
		add("FERRY_DATABASE_SCHEMA", pgdb.ValidateSchema(c.DatabaseSchema))
	}
	if c.DatabaseMaxConns < 2 {
		add("FERRY_DATABASE_MAX_CONNS", errors.New("must be at least 2 (the relay's listener holds one)"))
	}
	// What an operator can get wrong is checked here, by variable; the
	// components' own checks follow as the safety net (their messages name
	// Go fields, for library users who fill the structs themselves).
	for _, n := range rabbit.Nodes(c.AMQP.URL) {
		if u, err := url.Parse(n); err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" {
			add("FERRY_AMQP_URL", errors.New("must be an amqp:// or amqps:// URL with a host (a cluster's nodes: several, comma-separated)"))
		}
	}
	if err := rabbit.ValidateNodes(c.AMQP.URL); err != nil {
		add("FERRY_AMQP_URL", err)
	}
	if c.AMQP.QueueType != rabbit.QueueTypeQuorum && c.AMQP.QueueType != rabbit.QueueTypeClassic {
		add("FERRY_AMQP_QUEUE_TYPE", fmt.Errorf("must be %s or %s, got %q", rabbit.QueueTypeQuorum, rabbit.QueueTypeClassic, c.AMQP.QueueType))
	}
	if len(c.AMQP.Namespace) > rabbit.MaxNamespaceLength {
		add("FERRY_AMQP_NAMESPACE", fmt.Errorf("must be at most %d bytes", rabbit.MaxNamespaceLength))
	}
	if strings.HasPrefix(c.AMQP.Namespace, pipeline.ReservedTopicPrefix) {
		add("FERRY_AMQP_NAMESPACE", fmt.Errorf("must not start with %q: RabbitMQ keeps those names for itself and refuses to declare them", pipeline.ReservedTopicPrefix))
	}
	atLeast := func(hi, lo string, max, min time.Duration) {
		if max < min {
			add(hi, fmt.Errorf("must be at least %s (%s), got %s", lo, min, max))
		}
	}
	if c.Relay.CatchUpBatchSize < c.Relay.BatchSize {
		add("FERRY_RELAY_CATCH_UP_BATCH_SIZE", fmt.Errorf("must be at least FERRY_RELAY_BATCH_SIZE (%d), got %d", c.Relay.BatchSize, c.Relay.CatchUpBatchSize))
	}
	atLeast("FERRY_RETRY_MAX_INTERVAL", "FERRY_RETRY_INITIAL_INTERVAL", c.Retry.MaxInterval, c.Retry.InitialInterval)
	atLeast("FERRY_RELAY_BACKOFF_MAX", "FERRY_RELAY_BACKOFF_INITIAL", c.Relay.Backoff.Max, c.Relay.Backoff.Initial)
	atLeast("FERRY_DURABLE_RETRY_MAX", "FERRY_DURABLE_RETRY_INITIAL", c.DurableRetry.Backoff.Max, c.DurableRetry.Backoff.Initial)
	switch c.RelayMode {
	case RelayModeNotify, RelayModePoll, RelayModeCDC:
	default:
		add("FERRY_RELAY_MODE", fmt.Errorf("must be %s, %s or %s, got %q", RelayModeNotify, RelayModePoll, RelayModeCDC, c.RelayMode))
	}
	if c.CDCSafetyNetInterval <= 0 {
		add("FERRY_CDC_SAFETY_NET_INTERVAL", errors.New("must be positive"))
	}
	if c.CDCSafetyNetMinAge <= 0 {
		add("FERRY_CDC_SAFETY_NET_MIN_AGE", errors.New("must be positive"))
	}
	if c.CDC.HeartbeatInterval <= 0 {
		add("FERRY_CDC_HEARTBEAT_INTERVAL", errors.New("must be positive"))
	}
	if c.AMQP.Heartbeat != 0 && c.AMQP.Heartbeat < time.Second {
		add("FERRY_AMQP_HEARTBEAT", fmt.Errorf("must be at least 1s, got %s", c.AMQP.Heartbeat))
	}
	if c.DurableRetry.MaxAttempts < 1 {
		add("FERRY_DURABLE_RETRY_MAX_ATTEMPTS", errors.New("must be at least 1"))
	}
	if c.Fleet.Reload < 100*time.Millisecond {
		add("FERRY_TENANTS_RELOAD", fmt.Errorf("must be at least 100ms, got %s", c.Fleet.Reload))
	}
	if c.Fleet.Sweep < time.Second {
		add("FERRY_TENANTS_SWEEP", fmt.Errorf("must be at least 1s, got %s", c.Fleet.Sweep))
	}
	if c.Fleet.Pools.Budget < int(c.Fleet.Pools.MaxConns) {
		add("FERRY_TENANTS_CONN_BUDGET", fmt.Errorf("must be at least FERRY_TENANT_MAX_CONNS (%d), got %d", c.Fleet.Pools.MaxConns, c.Fleet.Pools.Budget))
	}
	if c.Fleet.Pools.IdleAfter < time.Second {
		add("FERRY_TENANT_IDLE_AFTER", fmt.Errorf("must be at least 1s, got %s", c.Fleet.Pools.IdleAfter))
	}
	if c.Tenants && c.RelayMode == RelayModeCDC {
		add("FERRY_TENANTS", errors.New("the tenant fleet relays by wake-ups and sweeps, not from the WAL: use FERRY_RELAY_MODE=notify or poll with it"))
	}
	if len(errs) == 0 {
		add("FERRY_AMQP_*", c.AMQP.Validate())
		add("FERRY_RELAY_*", c.Relay.Validate())
		add("FERRY_CDC_*", c.CDC.Validate())
		add("FERRY_RETRY_*", c.Retry.Validate())
		add("FERRY_DURABLE_RETRY_*", c.DurableRetry.Backoff.Validate())
	}
	if c.Retention.Outbox <= 0 || c.Retention.Ledger <= 0 || c.Retention.ToolCalls <= 0 || c.Retention.PoisonArchive <= 0 || c.Retention.Interval <= 0 || c.Retention.BatchSize <= 0 {
		add("FERRY_*_RETENTION / FERRY_PRUNE_*", errors.New("retentions, interval and batch size must be positive"))
	}
	if c.Retention.Ledger < time.Hour {
		add("FERRY_LEDGER_RETENTION", errors.New("must be at least 1h: a shorter ledger forgets messages that may still be redelivered"))
	}
	if c.Retention.Ledger > pgweeks.MaxRetention {
		add("FERRY_LEDGER_RETENTION", fmt.Errorf("must be at most %s: the ledger's %d weekly partitions are cleared whole before each is reused", pgweeks.MaxRetention, pgweeks.Slots))
	}
	if c.Retention.Outbox > pgweeks.MaxRetention {
		add("FERRY_OUTBOX_RETENTION", fmt.Errorf("must be at most %s: the outbox's %d weekly partitions are cleared whole before each is reused; archive (FERRY_OUTBOX_ARCHIVE) to keep rows longer", pgweeks.MaxRetention, pgweeks.Slots))
	}
	if c.AdminToken != "" && len(c.AdminToken) < MinAdminTokenLength {
		add("FERRY_ADMIN_TOKEN", fmt.Errorf("must be at least %d characters (or unset, which turns the state-changing endpoints off)", MinAdminTokenLength))
	}
	if c.MCPToken != "" && len(c.MCPToken) < MinAdminTokenLength {
		add("FERRY_MCP_TOKEN", fmt.Errorf("must be at least %d characters", MinAdminTokenLength))
	}
	if h := c.HTTPServer; h.ReadHeaderTimeout <= 0 || h.ReadTimeout <= 0 || h.WriteTimeout <= 0 || h.IdleTimeout <= 0 || h.MaxHeaderBytes <= 0 || h.MaxConns <= 0 {
		add("FERRY_HTTP_*", errors.New("timeouts, header size and connection cap must be positive"))
	}
	if c.Ledger.TakeOverAfter > 0 && c.Ledger.TakeOverAfter < time.Second {
		add("FERRY_LEDGER_TAKEOVER_AFTER", errors.New("must be at least 1s, or off: a handler's transaction is silent between its statements for a moment, and only one gone silent for good may be ended"))
	}
	if c.MetricsRefresh <= 0 {
		add("FERRY_METRICS_REFRESH", errors.New("must be positive"))
	}
	if c.ShutdownTimeout <= 0 {
		add("FERRY_SHUTDOWN_TIMEOUT", errors.New("must be positive"))
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		add("FERRY_LOG_LEVEL", err)
	}
	switch c.LogFormat {
	case "json", "text", "auto":
	default:
		add("FERRY_LOG_FORMAT", fmt.Errorf("must be json, text or auto, got %q", c.LogFormat))
	}
	return errors.Join(errs...)
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("must be debug, info, warn or error, got %q", s)
	}
	return l, nil
}

// UnknownVariables returns a warning for every FERRY_* variable of environ
// ("NAME=value" entries, as os.Environ gives them) that neither Ferry nor
// the application (extra) reads, with the nearest known name: a misspelt
// variable is otherwise ignored without a word.
func UnknownVariables(environ []string, extra []EnvVar) []string {
	known := map[string]bool{"FERRY_TEST_DATABASE_URL": true, "FERRY_TEST_AMQP_URL": true}
	for _, ev := range append(EnvVars(), extra...) {
		known[ev.Name] = true
	}
	var warnings []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "FERRY_") || known[name] {
			continue
		}
		best, bestD := "", 1<<30
		for k := range known {
			if d := editDistance(name, k); d < bestD || (d == bestD && k < best) {
				best, bestD = k, d
			}
		}
		w := name + " is not a variable Ferry or this application reads; it is ignored"
		if bestD <= max(2, len(name)/4) {
			w += " (did you mean " + best + "?)"
		}
		warnings = append(warnings, w)
	}
	slices.Sort(warnings)
	return warnings
}

// editDistance is the Levenshtein distance of a and b (written out: the
// standard library has none, and it is a dozen lines).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// parseHosts reads a comma-separated list of host names.
func parseHosts(v string) ([]string, error) {
	var hosts []string
	for _, h := range strings.Split(v, ",") {
		h = strings.TrimSpace(h)
		switch {
		case h == "":
			continue
		case strings.ContainsAny(h, "/@ \t") || strings.Count(h, ":") == 1:
			return nil, fmt.Errorf("%q is not a host name (give names without scheme, port or path)", h)
		}
		hosts = append(hosts, strings.Trim(h, "[]"))
	}
	if len(hosts) == 0 {
		return nil, errors.New("names no host")
	}
	return hosts, nil
}

// validHeaderName reports whether v is an HTTP header field name (RFC 9110
// token characters).
func validHeaderName(v string) bool {
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return v != ""
}
