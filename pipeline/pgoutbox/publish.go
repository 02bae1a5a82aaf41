package pgoutbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/jackc/pgx/v5"
)

// The step every lane shares: publish the rows a batch took, in order per
// aggregate, then record the outcome in the batch's transaction.

// orderKey is the aggregate whose order row c must keep, if its topic is ordered.
func (r *Relay) orderKey(c claimedRow) (string, bool) {
	if !slices.Contains(r.ordered, c.topic) {
		return "", false
	}
	return c.aggregateID, true
}

// shadow reports whether a claimed row is a shadow intent.
func (r *Relay) shadow(c claimedRow) bool {
	return c.shadowMarked || slices.Contains(r.cfg.ShadowTopics, c.topic)
}

// relayClaimed publishes the rows claimed in tx (shadow intents aside) and
// records the outcome: it ends tx. A publish that failed because the
// relay's own connection is down (pipeline.Infrastructure) is not the
// row's fault: the row is left as if not sent, with no attempt spent and
// no backoff, for whichever relay can reach the broker. A batch the broker
// confirmed none of is not recorded when that was the relay's outage
// (ErrBrokerUnreachable), or with holdOnOutage whatever the failures
// (ErrNothingConfirmed): the caller's rollback leaves every row as it was.
// record, if set, is the append-only lane's: the confirmed rows are not
// marked (the position passes them), and record adds its own statements to
// the outcome's, given the ids of the rows neither confirmed nor failed
// (behind a failure of their aggregate, or left when ctx ended): the
// append-only lane marks them slow and moves its position, in the same
// transaction.
func (r *Relay) relayClaimed(ctx context.Context, tx pgx.Tx, claimed []claimedRow, res BatchResult, holdOnOutage bool, record func(b *pgx.Batch, unsent []int64)) (BatchResult, error) {
	live, shadowed := r.splitShadow(claimed)
	outcomes, sent, unsent := r.publishInOrder(ctx, live)
	res.Left += len(unsent)
	o := r.sortOutcomes(ctx, outcomes, sent, unsent)
	res.Left += o.outages
	if len(o.ok) == 0 && o.outages > 0 {
		return res, fmt.Errorf("%w (%d message(s) not sent; first: %v)", ErrBrokerUnreachable, o.outages, o.outageErr)
	}
	if len(o.ok) == 0 && len(o.failIDs) > 0 && holdOnOutage {
		return res, fmt.Errorf("%w (%d message(s) failed; first: %v)", ErrNothingConfirmed, len(o.failIDs), outcomes[0].Err)
	}
	if err := r.recordOutcome(ctx, tx, o, shadowed, record); err != nil {
		return res, err
	}
	res.Dispatched, res.Failed, res.Shadowed = len(o.ok), len(o.failIDs), len(shadowed)
	for _, c := range shadowed {
		outcomes = append(outcomes, Outcome{ID: c.id, Topic: c.topic, AggregateID: c.aggregateID, CreatedAt: c.createdAt, DueAt: c.dueAt,
			Attempt: c.attempts + 1, Shadowed: true, At: time.Now()})
	}
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

// splitShadow sets the shadow intents apart: the legacy code performs
// their effect; they are recorded as dispatched (shadowed) and never
// reach the broker.
func (r *Relay) splitShadow(claimed []claimedRow) (live, shadowed []claimedRow) {
	live = claimed[:0:0]
	for _, c := range claimed {
		if r.shadow(c) {
			shadowed = append(shadowed, c)
			continue
		}
		live = append(live, c)
	}
	return live, shadowed
}

// sorted is a batch's outcome as it is recorded.
type sorted struct {
	ok, unsent          []int64
	failIDs, failDelays []int64
	failErrs            []string
	// outages counts the rows not sent because the relay's connection to
	// the broker is down (among unsent); outageErr is the first such error.
	outages   int
	outageErr error
}

// sortOutcomes sorts the publishes' outcomes into confirmed, failed (with
// the backoff each row waits) and not sent.
func (r *Relay) sortOutcomes(ctx context.Context, outcomes []Outcome, sent, unsent []claimedRow) sorted {
	var o sorted
	for _, c := range unsent {
		o.unsent = append(o.unsent, c.id)
	}
	for i, out := range outcomes {
		if out.Err == nil {
			o.ok = append(o.ok, out.ID)
			continue
		}
		if ctx.Err() != nil && errors.Is(out.Err, ctx.Err()) {
			// Stopping, not failing: the row stays pending as it was, and
			// the next relay sends it (again, if the broker had it).
			o.unsent = append(o.unsent, out.ID)
			continue
		}
		if pipeline.IsInfrastructure(out.Err) {
			// The relay's outage, not the row's: left as not sent, due at
			// once, for a relay that can reach the broker.
			o.unsent = append(o.unsent, out.ID)
			o.outages++
			if o.outageErr == nil {
				o.outageErr = out.Err
			}
			continue
		}
		delay := r.cfg.Backoff.Delay(out.Attempt)
		o.failIDs = append(o.failIDs, out.ID)
		o.failErrs = append(o.failErrs, pipeline.CleanText(out.Err.Error(), r.cfg.MaxErrorLength))
		o.failDelays = append(o.failDelays, delay.Microseconds())
		r.logger.Warn("publishing outbox row failed; will retry",
			"outbox_id", out.ID, "topic", out.Topic, "aggregate_id", out.AggregateID,
			"attempt", out.Attempt, "retry_in", delay, "trace_id", headerString(sent[i].headers, pipeline.MetaTraceID),
			"error", out.Err)
	}
	return o
}

// recordOutcome writes the batch's outcome and commits tx. The broker has
// the confirmed messages: they are recorded even if ctx was cancelled
// meanwhile, so a graceful stop causes no redelivery.
func (r *Relay) recordOutcome(ctx context.Context, tx pgx.Tx, o sorted, shadowed []claimedRow, record func(b *pgx.Batch, unsent []int64)) error {
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	batch := &pgx.Batch{}
	if len(o.ok) > 0 && (record == nil || r.markEach.Load()) {
		// The append-only lane's rows are dispatched by its position, and
		// marked too only while a relay of an earlier version runs.
		batch.Queue(r.dispatchedSQL, o.ok)
	}
	if len(o.failIDs) > 0 {
		batch.Queue(r.failedSQL, o.failIDs, o.failErrs, o.failDelays)
	}
	if len(shadowed) > 0 {
		ids := make([]int64, len(shadowed))
		for i, c := range shadowed {
			ids[i] = c.id
		}
		batch.Queue(r.shadowSQL, ids)
	}
	if record != nil {
		record(batch, o.unsent)
	}
	if batch.Len() > 0 {
		if err := tx.SendBatch(finishCtx, batch).Close(); err != nil {
			return fmt.Errorf("recording relay outcome of %d row(s): %w", len(o.ok)+len(o.failIDs)+len(shadowed), err)
		}
	}
	if err := tx.Commit(finishCtx); err != nil {
		return fmt.Errorf("committing relay batch: %w", err)
	}
	return nil
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
		for k, v := range r.cfg.Stamp {
			msg.Metadata.Set(k, v)
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
		// A broker that answers nothing (a black hole) must not keep the
		// batch, and the position it holds, past ConfirmTimeout.
		pctx, cancel := context.WithTimeout(ctx, r.cfg.ConfirmTimeout)
		errs := bp.PublishBatch(pctx, batch)
		timedOut := pctx.Err() != nil && ctx.Err() == nil
		cancel()
		now := time.Now()
		for i, err := range errs {
			if err != nil && timedOut && errors.Is(err, context.DeadlineExceeded) {
				err = pipeline.Infrastructure(fmt.Errorf("no confirm from the broker within %s (FERRY_RELAY_CONFIRM_TIMEOUT): %w", r.cfg.ConfirmTimeout, err))
			}
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

func rollback(ctx context.Context, tx pgx.Tx) {
	rbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	_ = tx.Rollback(rbCtx) // the error that caused it is the one to report
}
