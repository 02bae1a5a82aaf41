package pgoutbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults and bounds of RelayConfig.
const (
	DefaultRelayBatchSize    = 100
	MaxRelayBatchSize        = 10_000
	DefaultRelayPollInterval = 500 * time.Millisecond
	DefaultMaxErrorLength    = 2048
	// finishTimeout bounds the write that records a batch's outcome after
	// the relay was asked to stop: the broker already has those messages,
	// and recording them saves a redelivery.
	finishTimeout = 5 * time.Second
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Table is the outbox table's name. Default "outbox".
	Table string
	// BatchSize is how many rows one claim takes. Default 100, at most 10000.
	BatchSize int
	// PollInterval is how long the relay sleeps when the outbox has nothing
	// due. Default 500ms.
	PollInterval time.Duration
	// Backoff is the schedule of a row's retries after failed publishes.
	// Default 30s doubling, capped at 15m, with 20% jitter.
	Backoff pipeline.Backoff
	// MaxErrorLength truncates last_error. Default 2048 bytes.
	MaxErrorLength int
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c RelayConfig) WithDefaults() RelayConfig {
	if c.Table == "" {
		c.Table = "outbox"
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultRelayBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultRelayPollInterval
	}
	if c.MaxErrorLength == 0 {
		c.MaxErrorLength = DefaultMaxErrorLength
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
	if c.PollInterval <= 0 {
		errs = append(errs, fmt.Errorf("RelayConfig.PollInterval must be positive, got %s", c.PollInterval))
	}
	if c.MaxErrorLength < 1 {
		errs = append(errs, errors.New("RelayConfig.MaxErrorLength must be positive"))
	}
	if err := c.Backoff.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("RelayConfig.%w", err))
	}
	return errors.Join(errs...)
}

// Relay moves committed, due, undispatched outbox rows to a broker.
//
// Each batch is one transaction: claim rows with FOR UPDATE SKIP LOCKED,
// publish each (the publisher must wait for the broker's confirm), then mark
// the confirmed rows dispatched and push the failed ones out by Backoff,
// recording attempts and last_error. If the relay dies anywhere before the
// commit, its locks go with its connection and another relay (or its next
// run) publishes those rows again: delivery is at least once, and consumers
// deduplicate by message id, which is the outbox id.
type Relay struct {
	pool   *pgxpool.Pool
	pub    message.Publisher
	cfg    RelayConfig
	logger *slog.Logger

	claimSQL, dispatchedSQL, failedSQL string

	dispatched, failed atomic.Int64
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
	t := pgx.Identifier{cfg.Table}.Sanitize()
	return &Relay{
		pool:   pool,
		pub:    pub,
		cfg:    cfg,
		logger: logger.With("component", "relay"),
		// ORDER BY available_at follows the partial index on pending rows,
		// so the claim stays an index range scan at any table size.
		claimSQL: `SELECT id, aggregate_id, topic, payload, headers, attempts, created_at
			FROM ` + t + `
			WHERE dispatched_at IS NULL AND available_at <= now()
			ORDER BY available_at
			LIMIT $1
			FOR UPDATE SKIP LOCKED`,
		dispatchedSQL: `UPDATE ` + t + ` SET dispatched_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`,
		failedSQL: `UPDATE ` + t + ` AS o
			SET attempts = o.attempts + 1, last_error = f.err,
			    available_at = now() + f.delay_us * interval '1 microsecond'
			FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, err, delay_us)
			WHERE o.id = f.id`,
	}, nil
}

// BatchResult says what one RelayBatch did.
type BatchResult struct {
	Claimed    int
	Dispatched int
	Failed     int
}

// RelayStats are the relay's running totals.
type RelayStats struct {
	Dispatched int64
	Failed     int64
}

// Stats returns the relay's totals since it was created.
func (r *Relay) Stats() RelayStats {
	return RelayStats{Dispatched: r.dispatched.Load(), Failed: r.failed.Load()}
}

// Run relays until ctx is done. Database errors are logged and retried
// after PollInterval; they never end the loop, since the outbox is the
// place where work waits out an outage.
func (r *Relay) Run(ctx context.Context) error {
	r.logger.Info("relay started", "batch_size", r.cfg.BatchSize, "poll_interval", r.cfg.PollInterval)
	defer r.logger.Info("relay stopped")
	for {
		res, err := r.RelayBatch(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			r.logger.Error("relay batch failed", "error", err)
		}
		if err == nil && res.Claimed == r.cfg.BatchSize {
			continue // more is due: no sleep
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(r.cfg.PollInterval):
		}
	}
}

type claimedRow struct {
	id          int64
	aggregateID string
	topic       string
	payload     []byte
	headers     map[string]any
	attempts    int
	createdAt   time.Time
}

// RelayBatch claims one batch of due rows, publishes them and records the
// outcome, in one transaction.
func (r *Relay) RelayBatch(ctx context.Context) (res BatchResult, err error) {
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("beginning claim transaction: %w", err)
	}
	defer func() {
		if err != nil {
			rbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
			defer cancel()
			_ = tx.Rollback(rbCtx) // the error that caused it is the one to report
		}
	}()

	rows, err := tx.Query(ctx, r.claimSQL, r.cfg.BatchSize)
	if err != nil {
		return res, fmt.Errorf("claiming outbox rows: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (claimedRow, error) {
		var c claimedRow
		err := row.Scan(&c.id, &c.aggregateID, &c.topic, &c.payload, &c.headers, &c.attempts, &c.createdAt)
		return c, err
	})
	if err != nil {
		return res, fmt.Errorf("reading claimed outbox rows: %w", err)
	}
	res.Claimed = len(claimed)
	if len(claimed) == 0 {
		return res, tx.Commit(ctx)
	}

	var (
		okIDs               []int64
		failIDs, failDelays []int64
		failErrs            []string
	)
	for _, row := range claimed {
		if ctx.Err() != nil {
			break // stopping: record what the broker already has, leave the rest claimed by nobody
		}
		pubErr := r.publish(ctx, row)
		if pubErr == nil {
			okIDs = append(okIDs, row.id)
			continue
		}
		attempt := row.attempts + 1
		delay := r.cfg.Backoff.Delay(attempt)
		failIDs = append(failIDs, row.id)
		failErrs = append(failErrs, truncate(pubErr.Error(), r.cfg.MaxErrorLength))
		failDelays = append(failDelays, delay.Microseconds())
		r.logger.Warn("publishing outbox row failed; will retry",
			"outbox_id", row.id, "topic", row.topic, "aggregate_id", row.aggregateID,
			"attempt", attempt, "retry_in", delay, "trace_id", headerString(row.headers, pipeline.MetaTraceID),
			"error", pubErr)
	}

	// The broker has the confirmed messages: record them even if ctx was
	// cancelled meanwhile, so a graceful stop causes no redelivery.
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	batch := &pgx.Batch{}
	if len(okIDs) > 0 {
		batch.Queue(r.dispatchedSQL, okIDs)
	}
	if len(failIDs) > 0 {
		batch.Queue(r.failedSQL, failIDs, failErrs, failDelays)
	}
	if batch.Len() > 0 {
		if err := tx.SendBatch(finishCtx, batch).Close(); err != nil {
			return res, fmt.Errorf("recording relay outcome of %d row(s): %w", len(okIDs)+len(failIDs), err)
		}
	}
	if err := tx.Commit(finishCtx); err != nil {
		return res, fmt.Errorf("committing relay batch: %w", err)
	}
	res.Dispatched, res.Failed = len(okIDs), len(failIDs)
	r.dispatched.Add(int64(res.Dispatched))
	r.failed.Add(int64(res.Failed))
	if res.Dispatched > 0 {
		r.logger.Debug("relayed outbox rows", "dispatched", res.Dispatched, "failed", res.Failed)
	}
	return res, nil
}

func (r *Relay) publish(ctx context.Context, row claimedRow) error {
	msg := message.NewMessage(strconv.FormatInt(row.id, 10), row.payload)
	for k, v := range row.headers {
		msg.Metadata.Set(k, headerValue(v))
	}
	msg.Metadata.Set(pipeline.MetaAggregateID, row.aggregateID)
	msg.Metadata.Set(pipeline.MetaOutboxCreatedAt, row.createdAt.UTC().Format(time.RFC3339Nano))
	msg.Metadata.Set(pipeline.MetaOutboxAttempt, strconv.Itoa(row.attempts+1))
	msg.SetContext(ctx)
	return r.pub.Publish(row.topic, msg)
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

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	// Cut on a rune boundary: last_error is text, and PostgreSQL rejects invalid UTF-8.
	for n > 0 && n < len(s) && s[n]>>6 == 0b10 {
		n--
	}
	return s[:n]
}
