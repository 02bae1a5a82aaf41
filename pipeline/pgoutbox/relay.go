package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
)

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
	// txOptions begin each batch's transaction with the bound on its idle
	// time (RelayConfig.ConfirmTimeout).
	txOptions  pgx.TxOptions
	appendOnly appendLane
	t          Table

	dispatched, failed, probes, claims, replayed atomic.Int64
	// gateRestUntil is when the probe's snapshot gate opens again, in
	// Unix nanoseconds (idle).
	gateRestUntil atomic.Int64
	// idleConn is idleScan's connection, nil until its first use.
	idleMu   sync.Mutex
	idleConn *pgx.Conn
	// busyAt is when the relay last had work, in Unix nanoseconds (hot).
	busyAt atomic.Int64
	wake   chan struct{}
	// markEach: RelayConfig.MarkEachRow said so (or has not answered).
	markEach atomic.Bool
	// pageSize is the append-only lane's next page size (0: BatchSize), set by
	// each append-only batch from the page it read (nextPageSize).
	pageSize atomic.Int64
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
		t:             cfg.Table,
		appendOnly:    newAppendLane(cfg.Table, len(ordered) > 0, cfg.MinAge > 0),
		claimSQL:      cfg.Table.claimSQL(len(ordered) > 0, cfg.MinAge),
		headsSQL:      cfg.Table.headsSQL(cfg.MinAge),
		probeSQL:      cfg.Table.probeSQL(len(ordered) > 0, cfg.MinAge),
		lockSQL:       cfg.Table.lockSQL(len(ordered) > 0),
		dispatchedSQL: cfg.Table.markDispatchedSQL(),
		shadowSQL:     cfg.Table.markShadowedSQL(),
		failedSQL:     cfg.Table.markFailedSQL(),
		nextDueSQL:    cfg.Table.nextDueSQL(),
	}
	r.txOptions = pgx.TxOptions{BeginQuery: batchBeginSQL(cfg.ConfirmTimeout)}
	r.markEach.Store(cfg.MarkEachRow != nil)
	return r, nil
}

// batchIdleSlack is how much longer than the confirm timeout the server
// lets a batch's transaction sit idle (the statements that record the
// outcome come right after the publish).
const batchIdleSlack = 2 * time.Second

// batchBeginSQL begins a batch's transaction with its idle bound, in the
// same round trip (a simple-protocol BEGIN may carry more statements): a
// relay whose link to the database goes silent mid-batch holds the
// position, and only the server can end that hold.
func batchBeginSQL(confirmTimeout time.Duration) string {
	return fmt.Sprintf("BEGIN; SET LOCAL idle_in_transaction_session_timeout = %d", (confirmTimeout + batchIdleSlack).Milliseconds())
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

// RelayBatch relays one batch of each lane (see lanes.go), each in a
// transaction of its own: a page of the rows committed since the
// position, unless another relay holds it, then the slow lane's due rows.
func (r *Relay) RelayBatch(ctx context.Context) (BatchResult, error) {
	res, _, err := r.relayBatch(ctx, false)
	return res, err
}

// relayBatch is RelayBatch; held: another relay's batch held the
// position (and wait was false, or its wait ran out).
func (r *Relay) relayBatch(ctx context.Context, wait bool) (res BatchResult, held bool, err error) {
	res, took, err := r.appendBatch(ctx, wait)
	if err != nil {
		return res, false, err
	}
	slow, err := r.slowBatch(ctx)
	res.Claimed += slow.Claimed
	res.Missing = nil
	res.Dispatched += slow.Dispatched
	res.Failed += slow.Failed
	res.Shadowed += slow.Shadowed
	res.Left += slow.Left
	res.Ordered += slow.Ordered
	return res, !took, err
}
