package pgoutbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

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
	// DefaultRelayInFlight is how many batches one relay works on at once.
	// 1 until a benchmark on a quiet machine shows what 2 buys (see the
	// docs/performance.md).
	DefaultRelayInFlight  = 1
	MaxRelayInFlight      = 16
	DefaultMaxErrorLength = 2048
	// finishTimeout bounds the write that records a batch's outcome after
	// the relay was asked to stop: the broker already has those messages,
	// and recording them saves a redelivery.
	finishTimeout = 5 * time.Second
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Table is the outbox table's name. Default "outbox".
	Table string
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
	// due before it claims again whatever the probes and wake-ups said.
	// Default 500ms.
	PollInterval time.Duration
	// ProbeInterval is how often a relay with nothing to do asks the
	// outbox's pending index whether a claim would find a row (one indexed
	// SELECT EXISTS, no transaction, no lock), so that every commit is
	// relayed promptly, whoever made it: a PublishTx without Committed, a
	// program in another language, a plain INSERT. A wake-up (Committed,
	// InTx, LISTEN) is quicker still. Default 10ms (100 probes a second
	// per idle relay: see docs/performance.md for their cost); negative
	// turns probing off, leaving wake-ups and PollInterval.
	ProbeInterval time.Duration
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
}

// PublishSpans traces the relay's publishes.
type PublishSpans interface {
	// StartPublish starts the span of publishing msg (outbox row outboxID)
	// to topic, continuing the trace in msg's metadata and writing the
	// span's own context back into it, so that the consumer's span follows
	// from the publish. end finishes the span with the publish's outcome.
	StartPublish(ctx context.Context, topic string, outboxID int64, msg *message.Message) (end func(err error))
}

// Outcome is what happened to one claimed row.
type Outcome struct {
	ID          int64
	Topic       string
	AggregateID string
	CreatedAt   time.Time
	// DueAt is when the row first became due: its creation, or the time a
	// delay asked for (a scheduled event, a durable retry), before any
	// relay backoff. Dispatch latency counts from it.
	DueAt time.Time
	// Attempt is this publish's attempt number (1 for the first).
	Attempt int
	// Msg is the message as published.
	Msg *message.Message
	// Err is nil when the broker confirmed the message.
	Err error
	// At is when the publish returned: the broker's confirm for a
	// confirmed message. The row is marked dispatched just after.
	At time.Time
	// Shadowed is true for a shadow intent: marked dispatched, never
	// published (Msg is nil).
	Shadowed bool
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
	if c.InFlight == 0 {
		c.InFlight = DefaultRelayInFlight
	}
	if c.MaxErrorLength == 0 {
		c.MaxErrorLength = DefaultMaxErrorLength
	}
	if c.FailoverReplay == 0 {
		c.FailoverReplay = DefaultFailoverReplay
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
	if c.MinAge < 0 {
		errs = append(errs, fmt.Errorf("RelayConfig.MinAge must not be negative, got %s", c.MinAge))
	}
	if c.MaxErrorLength < 1 {
		errs = append(errs, errors.New("RelayConfig.MaxErrorLength must be positive"))
	}
	if err := c.Backoff.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("RelayConfig.%w", err))
	}
	if _, err := QuoteTable(c.Table); err != nil {
		errs = append(errs, fmt.Errorf("RelayConfig.Table: %w", err))
	}
	return errors.Join(errs...)
}

// Relay moves committed, due, undispatched outbox rows to a broker.
//
// Each batch is one transaction: read a page of the rows committed since
// the position (or claim slow rows with FOR UPDATE SKIP LOCKED), publish
// each (the publisher must wait for the broker's confirm), then move the
// position past the confirmed rows (slow rows: mark them dispatched) and
// make the failed ones slow, pushed out by Backoff with attempts and
// last_error. If the relay dies anywhere before the commit, its locks go
// with its connection and another relay (or its next run) publishes those
// rows again: delivery is at least once, and consumers deduplicate by
// message id: the publisher's message UUID.
//
// Ordered topics come from RelayConfig.OrderedTopics: a row of an
// ordered topic is claimed only when no earlier row of its aggregate (on any
// ordered topic) is pending, so a failing head event holds back the later
// ones instead of being overtaken.
type Relay struct {
	pool    *pgxpool.Pool
	pub     message.Publisher
	cfg     RelayConfig
	logger  *slog.Logger
	ordered []string

	claimSQL, headsSQL, lockSQL, dispatchedSQL, failedSQL, nextDueSQL, shadowSQL, probeSQL string
	fast                                                                                   fastLane
	// table is the outbox table's name as configured, quoted as quoted;
	// key is its row in PositionTable; timelineTable is where
	// CheckFailover records the timeline.
	table, quoted, key, timelineTable string

	dispatched, failed, probes, claims, replayed atomic.Int64
	wake                                         chan struct{}
	// markEach: RelayConfig.MarkEachRow said so (or has not answered).
	markEach atomic.Bool
	// pageSize is the fast lane's next page size (0: BatchSize), set by
	// each fast batch from the page it read (nextPageSize).
	pageSize atomic.Int64
}

// ClaimSQL is the slow lane's claim query for table (with $1 the batch
// size and, when ordered, $2 the ordered topics), for EXPLAIN and
// benchmarks.
func ClaimSQL(table string, ordered bool) (string, error) {
	t, err := QuoteTable(table)
	if err != nil {
		return "", err
	}
	return claimSQL(t, tableKey(table), ordered, 0), nil
}

// claimSQL selects the slow lane's due, unclaimed rows (see lanes.go).
// ORDER BY available_at follows the partial index on them, so the claim
// stays an index range scan at any table size. With ordered topics, a row
// of one is due only if every earlier pending row of its aggregate is a
// due row of the slow lane too: an aggregate's run of rows, from its head,
// goes in one batch (in waves, publishInOrder), so that a busy aggregate
// held behind a failure drains at a batch's size per batch, not one row.
// Each row comes with prev, the id of the aggregate's previous pending
// row (NULL at the head): runsFromHeads keeps a row only when prev was
// claimed by this batch too, so a run whose head another relay holds, or
// which LIMIT cut, stops there, and two relays never hold rows of one
// ordered aggregate at once. When it leaves rows out, headsSQL claims
// the runs of their aggregates from their heads (see slowBatch).
//
// minAge > 0 leaves younger rows alone: the CDC relay's safety net polls
// with it, so that it takes what the stream left, not what the stream is
// about to send.
func claimSQL(table, key string, ordered bool, minAge time.Duration) string {
	return claimColumns(table, ordered) + `
		WHERE ` + dueSQL(table, key, ordered, minAge, "$2", true) + `
		ORDER BY o.available_at
		LIMIT $1
		FOR UPDATE OF o SKIP LOCKED`
}

// headsSQL claims, as claimSQL, the due rows of ordered topics of the
// aggregates $3, in id order: each aggregate's run from its head. Rows
// held behind a failing head keep the due time they were written with,
// earlier than the head's backoff, so claimSQL's page, in due time order,
// can hold only rows behind heads it did not reach: with more such rows
// than a batch, every claim took the same page and published none of it,
// and the ordered topics stalled for good (after a broker outage, or a
// failover replay that makes every row due at once). Every row of that
// page is due, so each of its aggregates' earlier rows is due too: its
// head is due, unless another relay holds it. Index probes of the slow
// lane's (aggregate_id, id) index, per aggregate: a scan of the whole lane
// for its heads took seconds per claim with 50,000 rows waiting.
func headsSQL(table, key string, minAge time.Duration) string {
	return claimColumns(table, true) + `
		WHERE o.aggregate_id = ANY($3::text[]) AND o.topic = ANY($2::text[])
		  AND ` + dueSQL(table, key, true, minAge, "$2", true) + `
		ORDER BY o.aggregate_id, o.id
		LIMIT $1
		FOR UPDATE OF o SKIP LOCKED`
}

// claimColumns is the SELECT of the slow lane's claims, with prev.
func claimColumns(table string, ordered bool) string {
	prev := `NULL::bigint`
	if ordered {
		// Every earlier pending row is a slow one (the claims' condition):
		// the previous is the nearest by the slow lane's (aggregate_id,
		// id) index.
		prev = `CASE WHEN o.topic = ANY($2::text[]) THEN (SELECT max(p.id) FROM ` + table + ` p
		        WHERE p.aggregate_id = o.aggregate_id AND ` + slowCond("p") + `
		          AND p.id < o.id AND p.topic = ANY($2::text[])) END`
	}
	return `SELECT o.id, o.message_uuid, o.aggregate_id, o.topic,
		       COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')), o.headers, o.attempts, o.created_at, COALESCE(o.due_at, o.created_at),
		       COALESCE(o.headers->>'` + pipeline.MetaShadow + `' = 'true', false), ` + prev + `
		FROM ` + table + ` o`
}

// probeSQL asks whether a batch would find a row, without claiming
// (topics, when ordered, the ordered topics as $1): a due row of the slow
// lane, or a row the position has not passed. Index probes, no
// transaction, no lock.
func probeSQL(table, key string, ordered bool, minAge time.Duration) string {
	young := ""
	if minAge > 0 {
		young = ` AND o.created_at <= now() - ` + strconv.FormatInt(minAge.Microseconds(), 10) + ` * interval '1 microsecond'`
	}
	return `SELECT EXISTS (SELECT 1 FROM ` + table + ` o WHERE ` + dueSQL(table, key, ordered, minAge, "$1", false) + `)
		OR EXISTS (` + unpassedRows("1", table, key) + young + `)`
}

// dueSQL is the condition on outbox row o that makes it the slow lane's
// claim: slow and pending, due, old enough, and, when ordered (topics the
// placeholder of the ordered topics), the head of its aggregate or, with
// runs, behind due rows of the slow lane only (see claimSQL).
func dueSQL(table, key string, ordered bool, minAge time.Duration, topics string, runs bool) string {
	q := slowCond("o") + ` AND o.available_at <= now()`
	if minAge > 0 {
		q += ` AND o.created_at <= now() - ` + strconv.FormatInt(minAge.Microseconds(), 10) + ` * interval '1 microsecond'`
	}
	if ordered {
		before := earlierPending("o", table, key, topics, "")
		if runs {
			before = earlierPending("o", table, key, topics, "", `p.available_at > now()`)
		}
		q += `
		  AND (o.topic <> ALL(` + topics + `::text[]) OR NOT ` + before + `)`
	}
	return q
}

// earlierPending is true when an earlier row of o's aggregate, of an
// ordered topic (topics), is pending: with state of its own (the slow
// lane's partial index), or not passed by the position yet (the
// aggregate's rows since the position's oldest transaction, by the
// (aggregate_id, tx) index). except, if set, is a condition on p that
// leaves rows out; slowOnly, if given, one the slow rows must meet too to
// count.
func earlierPending(o, table, key, topics, except string, slowOnly ...string) string {
	if except != "" {
		except = ` AND NOT (` + except + `)`
	}
	slowExtra := ""
	for _, c := range slowOnly {
		slowExtra += ` AND ` + c
	}
	pos := positionSnap(table, key)
	return `(EXISTS (SELECT 1 FROM ` + table + ` p
		        WHERE p.aggregate_id = ` + o + `.aggregate_id AND ` + slowCond("p") + slowExtra + `
		          AND p.id < ` + o + `.id AND p.topic = ANY(` + topics + `::text[])` + except + `)
		    OR EXISTS (SELECT 1 FROM ` + table + ` p
		        WHERE p.aggregate_id = ` + o + `.aggregate_id AND p.tx >= pg_snapshot_xmin(` + pos + `)
		          AND p.dispatched_at IS NULL AND NOT p.slow
		          AND p.id < ` + o + `.id AND p.topic = ANY(` + topics + `::text[])` + except + `
		          AND NOT ` + passedCond("p", table, key) + `))`
}

// lockSQL is RelayIDs' query ($1 the ids, $2 the ordered topics when
// ordered): every row of $1 with its topic and aggregate, and, for each row
// it could lock, what RelayIDs needs to decide. Another relay's locked rows
// come back with locked false (read without waiting, at their committed
// version: topic and aggregate never change), so RelayIDs knows which
// aggregate they hold back. A row is done when marked dispatched or passed
// by the position.
func lockSQL(table, key string, ordered bool) string {
	behind := `false`
	if ordered {
		behind = `(l.topic = ANY($2::text[]) AND ` + earlierPending("l", table, key, "$2", "p.id = ANY($1::bigint[])") + `)`
	}
	return `WITH l AS (
		SELECT o.id, o.message_uuid, o.aggregate_id, o.topic,
		       COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')) AS payload, o.headers, o.attempts, o.created_at, COALESCE(o.due_at, o.created_at) AS due_at,
		       COALESCE(o.headers->>'` + pipeline.MetaShadow + `' = 'true', false) AS shadow,
		       ` + DispatchedCond("o", table, key) + ` AS done, o.available_at <= now() AS due
		FROM ` + table + ` o
		WHERE o.id = ANY($1::bigint[])
		FOR UPDATE OF o SKIP LOCKED)
	SELECT a.id, a.topic, a.aggregate_id, l.id IS NOT NULL,
	       l.message_uuid, l.payload, l.headers, l.attempts, l.created_at, l.due_at, l.shadow, l.done, l.due,
	       CASE WHEN l.id IS NULL THEN NULL ELSE ` + behind + ` END
	FROM ` + table + ` a LEFT JOIN l ON l.id = a.id
	WHERE a.id = ANY($1::bigint[])
	ORDER BY a.id`
}

// NewRelay returns a Relay reading pool's outbox and publishing with pub.
func NewRelay(pool *pgxpool.Pool, pub message.Publisher, cfg RelayConfig, logger *slog.Logger) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("pgoutbox: NewRelay needs a pool")
	}
	if pub == nil {
		return nil, errors.New("pgoutbox: NewRelay needs a publisher")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid relay config: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	t, err := QuoteTable(cfg.Table) // checked by Validate; quoted here once
	if err != nil {
		return nil, err
	}
	key := tableKey(cfg.Table)
	ordered := slices.Sorted(slices.Values(cfg.OrderedTopics))
	ordered = slices.Compact(ordered)
	if o, ok := pub.(pipeline.Ordering); ok {
		theirs := slices.Compact(slices.Sorted(slices.Values(o.OrderedTopics())))
		if !slices.Equal(ordered, theirs) {
			return nil, fmt.Errorf("pgoutbox: RelayConfig.OrderedTopics %v differ from the publisher's ordered topics %v: pass the topology's (rabbit.Topology.OrderedTopics)", ordered, theirs)
		}
	}
	r := &Relay{
		pool:          pool,
		pub:           pub,
		cfg:           cfg,
		ordered:       ordered,
		logger:        logger.With("component", "relay"),
		wake:          make(chan struct{}, 1),
		table:         cmp.Or(cfg.Table, DefaultTable),
		quoted:        t,
		timelineTable: timelineTable(t),
		key:           key,
		fast:          newFastLane(t, len(ordered) > 0, cfg.MinAge > 0),
		claimSQL:      claimSQL(t, key, len(ordered) > 0, cfg.MinAge),
		headsSQL:      headsSQL(t, key, cfg.MinAge),
		probeSQL:      probeSQL(t, key, len(ordered) > 0, cfg.MinAge),
		lockSQL:       lockSQL(t, key, len(ordered) > 0),
		dispatchedSQL: `UPDATE ` + t + ` SET dispatched_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`,
		shadowSQL:     `UPDATE ` + t + ` SET dispatched_at = now(), shadowed = true WHERE id = ANY($1)`,
		nextDueSQL:    `SELECT min(available_at) FROM ` + t + ` o WHERE ` + slowCond("o"),
		// A failed row keeps its state itself from now on: the slow lane.
		failedSQL: `UPDATE ` + t + ` AS o
			SET attempts = o.attempts + 1, last_error = f.err, slow = true,
			    available_at = now() + f.delay_us * interval '1 microsecond'
			FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, err, delay_us)
			WHERE o.id = f.id`,
	}
	r.markEach.Store(cfg.MarkEachRow != nil)
	return r, nil
}

// OrderedTopics are the topics whose order per aggregate the relay keeps
// (RelayConfig.OrderedTopics).
func (r *Relay) OrderedTopics() []string { return slices.Clone(r.ordered) }

// BatchResult says what one RelayBatch did.
type BatchResult struct {
	Claimed int
	// Passed counts the rows the append-only lane's position moved past
	// (see lanes.go): those claimed, and those it marked slow (delayed,
	// held behind an earlier row of their aggregate).
	Passed     int
	Dispatched int
	Failed     int
	// Shadowed counts shadow intents marked dispatched without publishing.
	Shadowed int
	// Left counts rows RelayIDs left pending for the polling relay
	// (delayed, held by another relay, or behind an earlier pending row of
	// an ordered aggregate) or did not send because an earlier row of their
	// aggregate failed.
	Left int
	// Skipped counts rows RelayIDs found already dispatched.
	Skipped int
	// Ordered counts the claimed rows of ordered topics. A claim holds one
	// row per ordered aggregate, its head, so a later row of the aggregate
	// may be due as soon as this batch commits.
	Ordered int
	// Missing are the ids RelayIDs did not find: deleted, or committed so
	// recently that the commit is not yet visible (logical decoding can
	// deliver a commit a moment before the committing session makes it
	// visible), so worth asking for again.
	Missing []int64
}

// RelayStats are the relay's running totals.
type RelayStats struct {
	Dispatched int64
	Failed     int64
	// Probes counts the idle relay's looks at the pending index
	// (RelayConfig.ProbeInterval).
	Probes int64
	// Claims counts its claims, those that found nothing included.
	Claims int64
	// Replayed counts the events it made pending again after finding the
	// database promoted (RelayConfig.FailoverReplay).
	Replayed int64
}

// Stats returns the relay's totals since it was created.
func (r *Relay) Stats() RelayStats {
	return RelayStats{Dispatched: r.dispatched.Load(), Failed: r.failed.Load(), Probes: r.probes.Load(), Claims: r.claims.Load(), Replayed: r.replayed.Load()}
}

// Wake makes a sleeping relay look for work now. The LISTEN/NOTIFY
// listener calls it; so can a producer in the same process.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Run relays until ctx is done. Database errors are logged and retried
// after PollInterval; they never end the loop, since the outbox is the
// place where work waits out an outage.
func (r *Relay) Run(ctx context.Context) error {
	r.logger.Info("relay started", "batch_size", r.cfg.BatchSize, "in_flight", r.cfg.InFlight, "poll_interval", r.cfg.PollInterval, "probe_interval", r.cfg.ProbeInterval,
		"ordered_topics", r.ordered, "notify", !r.cfg.PollOnly)
	defer r.logger.Info("relay stopped")
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if !r.cfg.PollOnly {
		go r.listen(ctx)
	}
	if r.cfg.MarkEachRow != nil {
		r.checkMarkEachRow(ctx)
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case <-time.After(markCheckInterval):
					r.checkMarkEachRow(ctx)
				}
			}
		}()
	}
	if r.cfg.FailoverReplay > 0 {
		// Before the first claim: what a failover left to replay goes
		// first, ahead of the rows committed since.
		if _, err := r.CheckFailover(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn("relay could not check the database's timeline for a failover", "error", err)
		}
		go r.watchFailover(ctx)
	}
	var wg sync.WaitGroup
	for range r.cfg.InFlight {
		wg.Go(func() { r.loop(ctx) })
	}
	wg.Wait()
	return nil
}

// markCheckInterval is how often RelayConfig.MarkEachRow is asked.
const markCheckInterval = 5 * time.Second

// checkMarkEachRow asks RelayConfig.MarkEachRow; a failed answer keeps
// the last one.
func (r *Relay) checkMarkEachRow(ctx context.Context) {
	mark, err := r.cfg.MarkEachRow(ctx)
	if err != nil {
		if ctx.Err() == nil {
			r.logger.Warn("relay could not tell whether relays of an earlier version run; it keeps marking each row it sends", "error", err)
		}
		return
	}
	if r.markEach.Swap(mark) != mark {
		if mark {
			r.logger.Warn("a relay of an earlier version is running: this relay marks each row it sends, until it stops")
		} else {
			r.logger.Info("no relay of an earlier version runs: rows are passed, not marked")
		}
	}
}

// loop is one of the relay's batches in flight: claim, publish, record,
// again; asleep when nothing is due.
func (r *Relay) loop(ctx context.Context) {
	for {
		res, err := r.RelayBatch(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			r.logger.Error("relay batch failed", "error", err)
		}
		// More is due: a full batch, or one that sent heads of ordered
		// aggregates, whose next rows a claim could not hold alongside
		// them (a backlog behind a broker outage drains at claim speed,
		// not a row per aggregate per PollInterval). No sleep, and the
		// relay's other batches in flight join in.
		if err == nil && (res.Claimed >= r.cfg.BatchSize || res.Passed >= r.cfg.BatchSize || (res.Ordered > 0 && res.Dispatched > 0)) {
			r.Wake()
			continue
		}
		if r.cfg.ProbeInterval > 0 {
			r.idle(ctx)
			continue
		}
		sleep := r.cfg.PollInterval
		if err == nil && res.Claimed == 0 {
			// Idle: sleep only until the next delayed or backed-off row is
			// due. A relay that just relayed skips this read on its hot path;
			// new commits wake it, and PollInterval bounds the rest.
			sleep = r.untilNextDue(ctx)
		}
		r.sleep(ctx, sleep)
	}
}

// idle waits for work: a wake-up, a probe that finds a row a claim would
// take (a commit nobody announced, a delay or backoff run out), or
// PollInterval, whichever comes first. A probe that fails (the database
// gone) is not reported: the claim after PollInterval reports it.
func (r *Relay) idle(ctx context.Context) {
	var args []any
	if len(r.ordered) > 0 {
		args = append(args, r.ordered)
	}
	for deadline := time.Now().Add(r.cfg.PollInterval); ; {
		left := time.Until(deadline)
		if left <= 0 || !r.sleep(ctx, min(r.cfg.ProbeInterval, left)) {
			return
		}
		r.probes.Add(1)
		var due bool
		if err := r.pool.QueryRow(ctx, r.probeSQL, args...).Scan(&due); err == nil && due {
			return
		}
	}
}

// sleep waits d; false when it ended early: a wake-up, or ctx done.
func (r *Relay) sleep(ctx context.Context, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-r.wake:
		return false
	case <-timer.C:
		return true
	}
}

// untilNextDue is how long to sleep: until the earliest pending row is due
// (a delayed event, a row in backoff), but never past PollInterval, the
// bound on the cost of a lost notification.
func (r *Relay) untilNextDue(ctx context.Context) time.Duration {
	var next *time.Time
	if err := r.pool.QueryRow(ctx, r.nextDueSQL).Scan(&next); err != nil || next == nil {
		return r.cfg.PollInterval
	}
	return max(min(time.Until(*next), r.cfg.PollInterval), time.Millisecond)
}

// NotifyChannel is the channel a Waker notifies on after commits of new
// outbox rows; the payload is the outbox table's schema.
const NotifyChannel = "ferry_outbox"

// listen wakes the relay on every commit of new outbox rows in its schema.
// A lost connection is re-established after a pause; meanwhile the relay
// polls, so nothing but latency is lost.
func (r *Relay) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		r.logger.Warn("relay listener lost; polling until it is back", "error", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context) error {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("acquiring listener connection: %w", err)
	}
	// The connection leaves the pool: it is busy waiting for as long as the relay runs.
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	var schema string
	if err := conn.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		return fmt.Errorf("reading current schema: %w", err)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+NotifyChannel); err != nil {
		return fmt.Errorf("LISTEN %s: %w", NotifyChannel, err)
	}
	r.Wake() // rows committed before LISTEN took effect
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == "" || n.Payload == schema {
			r.Wake()
		}
	}
}

// shadow reports whether a claimed row is a shadow intent.
func (r *Relay) shadow(c claimedRow) bool {
	return c.shadowMarked || slices.Contains(r.cfg.ShadowTopics, c.topic)
}

type claimedRow struct {
	id          int64
	uuid        *string
	aggregateID string
	topic       string
	payload     []byte
	headers     map[string]any
	attempts    int
	createdAt   time.Time
	// dueAt is when the row first became due (due_at; its creation on rows
	// written before the column).
	dueAt time.Time
	// shadowMarked: shadow_mode "true" in the headers (Ferry's metadata,
	// never the payload).
	shadowMarked bool
	// prev is the slow lane's claim's: the id of the previous pending row
	// of the row's ordered aggregate, nil at its head (claimSQL).
	prev *int64
}

// RelayBatch relays one batch of each lane (see lanes.go), each in a
// transaction of its own: a page of the rows committed since the
// position, unless another relay holds it, then the slow lane's due rows.
func (r *Relay) RelayBatch(ctx context.Context) (BatchResult, error) {
	fast, _, err := r.fastBatch(ctx)
	if err != nil {
		return fast, err
	}
	slow, err := r.slowBatch(ctx)
	fast.Claimed += slow.Claimed
	fast.Missing = nil
	fast.Dispatched += slow.Dispatched
	fast.Failed += slow.Failed
	fast.Shadowed += slow.Shadowed
	fast.Left += slow.Left
	fast.Ordered += slow.Ordered
	return fast, err
}

// slowBatch claims one batch of the slow lane's due rows, publishes them
// and records the outcome, in one transaction.
func (r *Relay) slowBatch(ctx context.Context) (res BatchResult, err error) {
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("beginning claim transaction: %w", err)
	}
	defer func() {
		if err != nil {
			rollback(ctx, tx)
		}
	}()

	args := []any{r.cfg.BatchSize}
	if len(r.ordered) > 0 {
		args = append(args, r.ordered)
	}
	claimed, err := collectClaimed(ctx, tx, r.claimSQL, args...)
	if err != nil {
		return res, err
	}
	n := len(claimed)
	// The aggregates of the rows with a previous row, read before
	// runsFromHeads reuses the slice.
	var aggregates []string
	for _, c := range claimed {
		if c.prev != nil && !slices.Contains(aggregates, c.aggregateID) {
			aggregates = append(aggregates, c.aggregateID)
		}
	}
	if claimed = runsFromHeads(claimed); len(claimed) < n {
		// Rows behind heads the page did not reach: take their aggregates'
		// runs from the heads (headsSQL). Rows this batch holds already
		// come again; the others wait for the next claim.
		runs, err := collectClaimed(ctx, tx, r.headsSQL, append(args, aggregates)...)
		if err != nil {
			return res, err
		}
		claimed = append(claimed, runs...)
		slices.SortFunc(claimed, func(a, b claimedRow) int { return cmp.Compare(a.id, b.id) })
		claimed = runsFromHeads(slices.CompactFunc(claimed, func(a, b claimedRow) bool { return a.id == b.id }))
	}
	// Each aggregate's rows are a run from its head, in id order: cutting
	// the list in id order keeps a run of each.
	claimed = claimed[:min(len(claimed), r.cfg.BatchSize)]
	res.Claimed = len(claimed)
	r.claims.Add(1)
	if len(claimed) == 0 {
		return res, tx.Commit(ctx)
	}
	for _, c := range claimed {
		if _, ok := r.orderKey(c); ok {
			res.Ordered++
		}
	}
	return r.relayClaimed(ctx, tx, claimed, res, false, nil)
}

// collectClaimed runs a slow lane claim (claimSQL, headsSQL).
func collectClaimed(ctx context.Context, tx pgx.Tx, sql string, args ...any) ([]claimedRow, error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("claiming outbox rows: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (claimedRow, error) {
		var c claimedRow
		err := row.Scan(&c.id, &c.uuid, &c.aggregateID, &c.topic, &c.payload, &c.headers, &c.attempts, &c.createdAt, &c.dueAt, &c.shadowMarked, &c.prev)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading claimed outbox rows: %w", err)
	}
	return claimed, nil
}

// runsFromHeads keeps, of the claimed rows, those of unordered topics and,
// per ordered aggregate, its run from its head: a row whose previous
// pending row this batch did not take (another relay holds it, or LIMIT
// left it out) stays, locked until the batch ends, for a later batch, and
// so does every row after it.
func runsFromHeads(claimed []claimedRow) []claimedRow {
	slices.SortFunc(claimed, func(a, b claimedRow) int { return cmp.Compare(a.id, b.id) })
	kept := make(map[int64]bool, len(claimed))
	out := claimed[:0]
	for _, c := range claimed {
		if c.prev != nil && !kept[*c.prev] {
			continue
		}
		kept[c.id] = true
		out = append(out, c)
	}
	return out
}

func rollback(ctx context.Context, tx pgx.Tx) {
	rbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	_ = tx.Rollback(rbCtx) // the error that caused it is the one to report
}

// ErrNothingConfirmed is RelayIDs' answer when it published and the broker
// confirmed none of it: most likely the broker is unreachable. Nothing was
// recorded (the rows are as they were), so the caller can hold its
// position and try the same rows again.
var ErrNothingConfirmed = errors.New("pgoutbox: the broker confirmed none of the batch")

// RelayIDs relays the outbox rows with these ids, by the rules of
// RelayBatch: it is the CDC relay's way in, which learns from the WAL which
// rows committed and so needs no claim scan. In one transaction it locks
// the rows by primary key (FOR UPDATE SKIP LOCKED, so a polling relay and
// it never hold one row at once), publishes those it may and records the
// outcome. It leaves pending, for the polling relay, each row that is
// delayed (available_at in the future), held by another relay, or of an
// ordered topic and behind an earlier pending row of its aggregate; a
// later row of that aggregate in ids is left too, so order per aggregate
// holds. A row already dispatched (ids replayed after a crash) is skipped,
// not sent again. A row whose publish fails is recorded as RelayBatch
// records it (attempts, last_error, available_at by Backoff) and retried by
// the polling relay, unless the broker confirmed none of the batch: then
// nothing is recorded and the error is ErrNothingConfirmed.
func (r *Relay) RelayIDs(ctx context.Context, ids []int64) (res BatchResult, err error) {
	if len(ids) == 0 {
		return res, nil
	}
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("beginning relay transaction: %w", err)
	}
	defer func() {
		if err != nil {
			rollback(ctx, tx)
		}
	}()
	args := []any{ids}
	if len(r.ordered) > 0 {
		args = append(args, r.ordered)
	}
	rows, err := tx.Query(ctx, r.lockSQL, args...)
	if err != nil {
		return res, fmt.Errorf("locking outbox rows by id: %w", err)
	}
	type lockedRow struct {
		claimedRow
		locked, done, due, behind bool
	}
	found, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (lockedRow, error) {
		var c lockedRow
		// The row's columns are NULL where another relay holds the row.
		var attempts *int32
		var createdAt, dueAt *time.Time
		var shadow, done, due, behind *bool
		if err := row.Scan(&c.id, &c.topic, &c.aggregateID, &c.locked, &c.uuid, &c.payload, &c.headers, &attempts, &createdAt, &dueAt, &shadow, &done, &due, &behind); err != nil {
			return c, err
		}
		if c.locked {
			c.attempts, c.createdAt, c.dueAt = int(*attempts), *createdAt, *dueAt
			c.shadowMarked, c.done, c.due, c.behind = *shadow, *done, *due, *behind
		}
		return c, nil
	})
	if err != nil {
		return res, fmt.Errorf("reading locked outbox rows: %w", err)
	}
	if len(found) < len(ids) {
		seen := make(map[int64]bool, len(found))
		for _, c := range found {
			seen[c.id] = true
		}
		for _, id := range ids {
			if !seen[id] {
				res.Missing = append(res.Missing, id)
			}
		}
	}
	// A row of an ordered aggregate that is left blocks the aggregate's
	// later rows in this call.
	blocked := map[string]bool{}
	var claimed []claimedRow
	for _, c := range found {
		key, ordered := r.orderKey(c.claimedRow)
		switch {
		case ordered && blocked[key]:
			res.Left++
		case c.locked && c.done:
			res.Skipped++
		case !c.locked || !c.due || c.behind:
			res.Left++
			if ordered {
				blocked[key] = true
			}
		default:
			claimed = append(claimed, c.claimedRow)
		}
	}
	res.Claimed = len(claimed)
	r.claims.Add(1)
	if len(claimed) == 0 {
		return res, tx.Commit(ctx)
	}
	res, err = r.relayClaimed(ctx, tx, claimed, res, true, nil)
	if errors.Is(err, ErrNothingConfirmed) {
		return BatchResult{}, err
	}
	return res, err
}

// orderKey is the aggregate whose order row c must keep, if its topic is ordered.
func (r *Relay) orderKey(c claimedRow) (string, bool) {
	if !slices.Contains(r.ordered, c.topic) {
		return "", false
	}
	return c.aggregateID, true
}

// relayClaimed publishes the rows claimed in tx (shadow intents aside) and
// records the outcome: it ends tx. With holdOnOutage, a batch the broker
// confirmed none of is not recorded but reported as ErrNothingConfirmed.
// record, if set, is the append-only lane's: the confirmed rows are not
// marked (the position passes them), and record adds its own statements to
// the outcome's, given the ids
// of the rows neither confirmed nor failed (behind a failure of their
// aggregate, or left when ctx ended): the append-only lane marks them
// slow and moves its position, in the same transaction.
func (r *Relay) relayClaimed(ctx context.Context, tx pgx.Tx, claimed []claimedRow, res BatchResult, holdOnOutage bool, record func(b *pgx.Batch, unsent []int64)) (BatchResult, error) {
	// Shadow intents: the legacy code performs their effect; they are
	// recorded as dispatched (shadowed) and never reach the broker.
	live := claimed[:0:0]
	var shadowIDs []int64
	var shadowOutcomes []Outcome
	for _, c := range claimed {
		if r.shadow(c) {
			shadowIDs = append(shadowIDs, c.id)
			shadowOutcomes = append(shadowOutcomes, Outcome{ID: c.id, Topic: c.topic, AggregateID: c.aggregateID, CreatedAt: c.createdAt, DueAt: c.dueAt,
				Attempt: c.attempts + 1, Shadowed: true, At: time.Now()})
			continue
		}
		live = append(live, c)
	}
	claimed = live
	outcomes, sent, unsent := r.publishInOrder(ctx, claimed)
	res.Left += len(unsent)
	var (
		okIDs               []int64
		failIDs, failDelays []int64
		failErrs            []string
		unsentIDs           []int64
	)
	for _, c := range unsent {
		unsentIDs = append(unsentIDs, c.id)
	}
	for i, o := range outcomes {
		if o.Err == nil {
			okIDs = append(okIDs, o.ID)
			continue
		}
		if ctx.Err() != nil && errors.Is(o.Err, ctx.Err()) {
			// Stopping, not failing: the row stays pending as it was, and
			// the next relay sends it (again, if the broker had it).
			unsentIDs = append(unsentIDs, o.ID)
			continue
		}
		delay := r.cfg.Backoff.Delay(o.Attempt)
		failIDs = append(failIDs, o.ID)
		failErrs = append(failErrs, pipeline.CleanText(o.Err.Error(), r.cfg.MaxErrorLength))
		failDelays = append(failDelays, delay.Microseconds())
		r.logger.Warn("publishing outbox row failed; will retry",
			"outbox_id", o.ID, "topic", o.Topic, "aggregate_id", o.AggregateID,
			"attempt", o.Attempt, "retry_in", delay, "trace_id", headerString(sent[i].headers, pipeline.MetaTraceID),
			"error", o.Err)
	}
	if len(okIDs) == 0 && len(failIDs) > 0 && holdOnOutage {
		return res, fmt.Errorf("%w (%d message(s) failed; first: %v)", ErrNothingConfirmed, len(failIDs), outcomes[0].Err)
	}

	// The broker has the confirmed messages: record them even if ctx was
	// cancelled meanwhile, so a graceful stop causes no redelivery.
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	batch := &pgx.Batch{}
	if len(okIDs) > 0 && (record == nil || r.markEach.Load()) {
		// The append-only lane's rows are dispatched by its position, and
		// marked too only while a relay of an earlier version runs.
		batch.Queue(r.dispatchedSQL, okIDs)
	}
	if len(failIDs) > 0 {
		batch.Queue(r.failedSQL, failIDs, failErrs, failDelays)
	}
	if len(shadowIDs) > 0 {
		batch.Queue(r.shadowSQL, shadowIDs)
	}
	if record != nil {
		record(batch, unsentIDs)
	}
	if batch.Len() > 0 {
		if err := tx.SendBatch(finishCtx, batch).Close(); err != nil {
			return res, fmt.Errorf("recording relay outcome of %d row(s): %w", len(okIDs)+len(failIDs)+len(shadowIDs), err)
		}
	}
	if err := tx.Commit(finishCtx); err != nil {
		return res, fmt.Errorf("committing relay batch: %w", err)
	}
	res.Dispatched, res.Failed, res.Shadowed = len(okIDs), len(failIDs), len(shadowIDs)
	outcomes = append(outcomes, shadowOutcomes...)
	r.dispatched.Add(int64(res.Dispatched))
	r.failed.Add(int64(res.Failed))
	if r.cfg.Observer != nil {
		r.cfg.Observer(outcomes)
	}
	if res.Dispatched > 0 {
		r.logger.Debug("relayed outbox rows", "dispatched", res.Dispatched, "failed", res.Failed)
	}
	return res, nil
}

// publishInOrder publishes rows (sorted by id) in waves: a wave holds at
// most one row of each ordered aggregate, and a row goes out only after its
// aggregate's previous row was confirmed, so a failed publish is never
// overtaken by a later event of its aggregate. Rows of a polling claim are
// heads of distinct aggregates, so they make a single wave. It returns the
// outcomes with the rows they belong to, and the rows it did not send (behind
// a failure, or left when ctx ended), which stay pending untouched.
func (r *Relay) publishInOrder(ctx context.Context, rows []claimedRow) (outcomes []Outcome, sent, unsent []claimedRow) {
	next := rows
	for len(next) > 0 {
		var wave, later []claimedRow
		inWave := map[string]bool{}
		for _, c := range next {
			key, ordered := r.orderKey(c)
			if ordered && inWave[key] {
				later = append(later, c)
				continue
			}
			if ordered {
				inWave[key] = true
			}
			wave = append(wave, c)
		}
		out := r.publishAll(ctx, wave)
		outcomes = append(outcomes, out...)
		sent = append(sent, wave...)
		failed := map[string]bool{}
		for i, o := range out {
			if key, ordered := r.orderKey(wave[i]); ordered && o.Err != nil {
				failed[key] = true
			}
		}
		next = next[:0:0]
		for _, c := range later {
			if key, _ := r.orderKey(c); failed[key] || ctx.Err() != nil {
				failed[key] = true
				unsent = append(unsent, c)
				continue
			}
			next = append(next, c)
		}
	}
	return outcomes, sent, unsent
}

// publishAll publishes the claimed rows, in claim order, and says what
// became of each. A BatchPublisher sends them in one go; any other
// publisher gets them one by one. Rows left when ctx ends are reported as
// not published: they stay pending.
func (r *Relay) publishAll(ctx context.Context, rows []claimedRow) []Outcome {
	outcomes := make([]Outcome, len(rows))
	batch := make([]pipeline.Outgoing, len(rows))
	for i, row := range rows {
		id := strconv.FormatInt(row.id, 10)
		uuid := id // rows written before migration 00009 have no UUID of their own
		if row.uuid != nil {
			uuid = *row.uuid
		}
		msg := message.NewMessage(uuid, row.payload)
		for k, v := range row.headers {
			msg.Metadata.Set(k, headerValue(v))
		}
		if row.aggregateID != "" {
			msg.Metadata.Set(pipeline.MetaAggregateID, row.aggregateID)
		}
		msg.Metadata.Set(pipeline.MetaOutboxID, id)
		msg.Metadata.Set(pipeline.MetaOutboxCreatedAt, row.createdAt.UTC().Format(time.RFC3339Nano))
		msg.Metadata.Set(pipeline.MetaOutboxAttempt, strconv.Itoa(row.attempts+1))
		msg.SetContext(ctx)
		batch[i] = pipeline.Outgoing{Topic: row.topic, Msg: msg}
		outcomes[i] = Outcome{ID: row.id, Topic: row.topic, AggregateID: row.aggregateID, CreatedAt: row.createdAt, DueAt: row.dueAt, Attempt: row.attempts + 1, Msg: msg}
	}
	ends := make([]func(error), len(rows))
	for i, o := range batch {
		ends[i] = func(error) {}
		if r.cfg.Spans != nil {
			ends[i] = r.cfg.Spans.StartPublish(ctx, o.Topic, rows[i].id, o.Msg)
		}
	}
	if bp, ok := r.pub.(pipeline.BatchPublisher); ok {
		errs := bp.PublishBatch(ctx, batch)
		now := time.Now()
		for i, err := range errs {
			outcomes[i].Err, outcomes[i].At = err, now
			ends[i](err)
		}
		return outcomes
	}
	for i, o := range batch {
		if err := ctx.Err(); err != nil {
			outcomes[i].Err = err
			ends[i](err)
			continue
		}
		outcomes[i].Err = r.pub.Publish(o.Topic, o.Msg)
		outcomes[i].At = time.Now()
		ends[i](outcomes[i].Err)
	}
	return outcomes
}

// headerValue turns a headers value into metadata: strings as they are,
// anything else (written by hand, say) as its JSON text rather than lost.
func headerValue(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

func headerString(h map[string]any, key string) string {
	s, _ := h[key].(string)
	return s
}
