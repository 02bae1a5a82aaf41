package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults and bounds of RelayConfig.
const (
	DefaultRelayBatchSize = 100
	MaxRelayBatchSize     = 10_000
	// DefaultRelayCatchUpBatchSize is the largest page the relay reads
	// while it is behind (see RelayConfig.CatchUpBatchSize).
	DefaultRelayCatchUpBatchSize = 1000
	// catchUpPageBytes bounds a catch-up page by its payloads' size: events of
	// 1 kB make pages of CatchUpBatchSize, events of 100 kB stay at
	// BatchSize, as before catch-up pages (a relay's memory, the broker's
	// frame).
	catchUpPageBytes         = 8 << 20
	DefaultRelayPollInterval = 500 * time.Millisecond
	// DefaultRelayProbeInterval is how often an idle relay probes the
	// pending index (see RelayConfig.ProbeInterval).
	DefaultRelayProbeInterval = 10 * time.Millisecond
	// DefaultRelayIdleProbeInterval is how far apart an idle relay's
	// probes get (see RelayConfig.IdleProbeInterval).
	DefaultRelayIdleProbeInterval = 500 * time.Millisecond
	// DefaultRelayInFlight is how many batches one relay works on at once.
	// 1 until a benchmark on a quiet machine shows what 2 buys (see the
	// docs/performance.md).
	DefaultRelayInFlight = 1
	// DefaultRelayConfirmTimeout bounds the wait for a batch's confirms
	// (see RelayConfig.ConfirmTimeout).
	DefaultRelayConfirmTimeout = 5 * time.Second
	MaxRelayInFlight           = 16
	DefaultMaxErrorLength      = 2048
	// finishTimeout bounds the write that records a batch's outcome after
	// the relay was asked to stop: the broker already has those messages,
	// and recording them saves a redelivery.
	finishTimeout = 5 * time.Second
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Table is the outbox table (ParseTable). Default: the zero Table,
	// "outbox" in the search_path's schema.
	Table Table
	// OrderedTopics are the topics whose per-aggregate order the relay
	// keeps: pass the topology's (rabbit.Topology.OrderedTopics). Given
	// here, not guessed from the publisher, so that a publisher wrapped in
	// one of your own (metrics, a circuit breaker) keeps the order. A
	// publisher that reports its own (pipeline.Ordering) must agree.
	OrderedTopics []string
	// BatchSize is how many rows one claim takes. Default 100, at most 10000.
	BatchSize int
	// CatchUpBatchSize is how many rows a page of the rows committed since
	// the position takes while the relay is behind: after a page that came
	// back full, the next one takes up to CatchUpBatchSize rows (fewer when
	// the rows are large: about 8 MiB of payloads, never fewer
	// than BatchSize); a page that is not full brings it back to BatchSize.
	// Why: each batch is a transaction and a wait for the broker's
	// confirms, one batch at a time per outbox table. On a busy machine
	// that wait, not the rows, sets the rate, and a relay that fell behind
	// (a broker's pause, a deploy) drained a page of 100 at little more
	// than the rate it was fed: measured at 2,000 events/s on two cores, a
	// backlog of 40,000 took 63–100 s to clear with pages of 100, 13–21 s
	// with pages of 1,000. Default 1000 (BatchSize when larger), at most 10000.
	CatchUpBatchSize int
	// PollInterval is how long the relay sleeps when the outbox has nothing
	// due before it claims again whatever the probes and wake-ups said,
	// while it is busy (it had work within the last 2 s); an idle relay
	// whose probes cooled claims every 30 s (or PollInterval, if longer).
	// Default 500ms.
	PollInterval time.Duration
	// ProbeInterval is how often a relay with nothing to do, while it is
	// busy (it had work within the last 2 s), asks whether a claim would
	// find a row (the server's snapshot, then one indexed SELECT EXISTS; no
	// transaction, no lock), so that commits nobody announces are relayed
	// promptly under a steady load: a program in another language, a plain
	// INSERT, a pool Ferry does not watch (CommitWatch). A wake-up
	// (CommitWatch, Committed, InTx, LISTEN) is quicker still. Default
	// 10ms; negative turns probing off, leaving wake-ups and PollInterval.
	ProbeInterval time.Duration
	// IdleProbeInterval is how far apart the probes of an idle relay get:
	// past 2 s without work they space out, doubling from ProbeInterval up
	// to this. It bounds how long a commit nobody announces waits after a
	// silence; announced ones wake the relay at once. Default 500ms (two
	// snapshot reads a second: see docs/performance.md for the cost of
	// each loop at idle); ProbeInterval or less keeps the probes hot.
	IdleProbeInterval time.Duration
	// InFlight is how many batches the relay has in flight at once, each its
	// own transaction. One batch at a time, of all relays, moves an outbox
	// table's position (the rows sent at their first try); while it waits
	// for the broker's confirms the others work the slow lane (failed,
	// delayed and held rows), claimed with SKIP LOCKED and the
	// head-of-aggregate rule like separate relays, so order per aggregate
	// holds. More than one helps a relay that drains a slow-lane backlog
	// (after a broker outage), not the rate of first tries. Default 1, at
	// most 16.
	InFlight int
	// Backoff is the schedule of a row's retries after failed publishes.
	// Default 30s doubling, capped at 15m, with 20% jitter.
	Backoff pipeline.Backoff
	// MaxErrorLength truncates last_error. Default 2048 bytes.
	MaxErrorLength int
	// PollOnly turns off the LISTEN wake-up, leaving only polling. Default
	// false: the relay wakes when a producer's Waker says events committed.
	PollOnly bool
	// Observer, if set, is told the outcome of every committed batch
	// (metrics, benchmarks). It is called on the relay's goroutine: keep it quick.
	Observer func(outcomes []Outcome)
	// ShadowTopics are topics in shadow mode: their intents are marked
	// dispatched (and shadowed) without being published, like every intent
	// with metadata pipeline.MetaShadow "true" (set by pipeline.WithShadow).
	// Never the payload: business data (a client's JSON a producer embeds)
	// must not be able to suppress its own effect. Switching a topic live is
	// removing it here. Default: none.
	ShadowTopics []string
	// MinAge, if positive, makes the relay claim only rows at least this
	// old (by created_at). The CDC relay's safety-net poller uses it to stay
	// out of the stream's way. Default 0.
	MinAge time.Duration
	// FailoverReplay is how far back, from the last dispatch the database
	// knows, a relay makes dispatched events pending again when it finds the
	// database promoted since (a newer timeline: a failover). With
	// asynchronous replication the promoted standby can lack a consumer's
	// last ledger commits while it has the dispatches they followed; the
	// replay sends those events again and the consumers' ledger drops the
	// ones whose effect survived. Cover the consumers' queueing delay.
	// Needs migration 00022. Default 5m; negative turns it off.
	FailoverReplay time.Duration
	// ConfirmTimeout bounds how long a batch waits for the broker to take
	// and confirm its messages. A broker behind a black hole (packets
	// dropped, the connection kept open: a security group, a dead NAT
	// entry) answers nothing until the connection's heartbeat gives up,
	// and meanwhile the batch holds the position, which every relay of the
	// table needs. Past it, the messages not confirmed count as the
	// relay's outage (pipeline.Infrastructure): no attempt spent, the batch
	// records nothing of them, and relays that can reach the broker send
	// them (once more, if the broker had them: consumers deduplicate).
	// It also bounds, with 2 s more, how long the database keeps a relay
	// transaction idle between two statements
	// (idle_in_transaction_session_timeout): a relay whose database link
	// went silent mid-batch cannot roll back, and the server ends its
	// session, releasing the position, at that bound. Default 5s; at most
	// 10m.
	ConfirmTimeout time.Duration
	// MarkEachRow, if set, is asked at start and every few seconds whether
	// the relay must also mark each row it sends dispatched (dispatched_at),
	// as relays before migration 00024 did: true while such a relay is still
	// running (a rolling upgrade), since it takes every row without
	// dispatched_at for pending and would send again the rows this relay's
	// position passed. Until its first answer, and while it fails, the relay
	// marks. The app sets it (pgstatus.EarlierRelaysAlive). Default: never.
	MarkEachRow func(ctx context.Context) (bool, error)
	// Spans, if set, opens a span around each event's publish
	// (tracing.Tracer does, as a producer span in the event's trace).
	Spans PublishSpans
	// Stamp is metadata set on every message the relay publishes, over
	// the row's own headers. A tenant fleet's relay stamps tenant_id with
	// the tenant whose outbox it reads (tenancy.Fleet): the database an
	// event was committed in says whose it is, so a header written wrong
	// cannot send its effect into another tenant's database. Default: none.
	Stamp map[string]string
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c RelayConfig) WithDefaults() RelayConfig {
	if c.BatchSize == 0 {
		c.BatchSize = DefaultRelayBatchSize
	}
	if c.CatchUpBatchSize == 0 {
		c.CatchUpBatchSize = max(DefaultRelayCatchUpBatchSize, c.BatchSize)
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultRelayPollInterval
	}
	if c.ProbeInterval == 0 {
		c.ProbeInterval = DefaultRelayProbeInterval
	}
	if c.IdleProbeInterval == 0 {
		c.IdleProbeInterval = DefaultRelayIdleProbeInterval
	}
	if c.InFlight == 0 {
		c.InFlight = DefaultRelayInFlight
	}
	if c.MaxErrorLength == 0 {
		c.MaxErrorLength = DefaultMaxErrorLength
	}
	if c.FailoverReplay == 0 {
		c.FailoverReplay = DefaultFailoverReplay
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = DefaultRelayConfirmTimeout
	}
	c.Backoff = c.Backoff.WithDefaults()
	return c
}

// Validate reports every problem of c at once.
func (c RelayConfig) Validate() error {
	var errs []error
	if c.BatchSize < 1 || c.BatchSize > MaxRelayBatchSize {
		errs = append(errs, fmt.Errorf("RelayConfig.BatchSize must be in [1, %d], got %d", MaxRelayBatchSize, c.BatchSize))
	}
	if c.CatchUpBatchSize < c.BatchSize || c.CatchUpBatchSize > MaxRelayBatchSize {
		errs = append(errs, fmt.Errorf("RelayConfig.CatchUpBatchSize must be in [BatchSize (%d), %d], got %d", c.BatchSize, MaxRelayBatchSize, c.CatchUpBatchSize))
	}
	if c.PollInterval <= 0 {
		errs = append(errs, fmt.Errorf("RelayConfig.PollInterval must be positive, got %s", c.PollInterval))
	}
	if c.InFlight < 1 || c.InFlight > MaxRelayInFlight {
		errs = append(errs, fmt.Errorf("RelayConfig.InFlight must be in [1, %d], got %d", MaxRelayInFlight, c.InFlight))
	}
	if c.IdleProbeInterval < 0 {
		errs = append(errs, fmt.Errorf("RelayConfig.IdleProbeInterval must not be negative, got %s", c.IdleProbeInterval))
	}
	if c.ConfirmTimeout <= 0 || c.ConfirmTimeout > 10*time.Minute {
		errs = append(errs, fmt.Errorf("RelayConfig.ConfirmTimeout must be in (0, 10m], got %s", c.ConfirmTimeout))
	}
	if c.MinAge < 0 {
		errs = append(errs, fmt.Errorf("RelayConfig.MinAge must not be negative, got %s", c.MinAge))
	}
	if c.MaxErrorLength < 1 {
		errs = append(errs, errors.New("RelayConfig.MaxErrorLength must be positive"))
	}
	if err := c.Backoff.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("RelayConfig.%w", err))
	}
	return errors.Join(errs...)
}
