package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/pipeline"
)

// The relay's loops: the batches in flight, the idle wait with its probe,
// the LISTEN wake-up and the watches (failover, earlier relays).

// Run relays until ctx is done. Database errors are logged and retried
// after PollInterval; they never end the loop, since the outbox is the
// place where work waits out an outage.
func (r *Relay) Run(ctx context.Context) error {
	r.logger.Info("relay started", "batch_size", r.cfg.BatchSize, "in_flight", r.cfg.InFlight, "poll_interval", r.cfg.PollInterval, "probe_interval", r.cfg.ProbeInterval, "idle_probe_interval", r.cfg.IdleProbeInterval,
		"ordered_topics", r.ordered, "notify", !r.cfg.PollOnly)
	defer r.logger.Info("relay stopped")
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer r.closeIdleConn()
	if !r.cfg.PollOnly {
		go r.listen(ctx)
	}
	// The watches answer once before the first batch (whether to mark
	// each row; what a failover left to replay goes first, ahead of the
	// rows committed since), then every few seconds.
	var watches []periodic.Service
	if r.cfg.MarkEachRow != nil {
		if err := r.checkMarkEachRow(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn(markEachUnknown, "error", err)
		}
		watches = append(watches, periodic.Service{Name: "relay-mark-each-watch", Interval: markCheckInterval,
			Tick: r.checkMarkEachRow, ErrorMessage: markEachUnknown})
	}
	if r.cfg.FailoverReplay > 0 {
		check := func(ctx context.Context) error {
			_, err := r.CheckFailover(ctx)
			return err
		}
		if err := check(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn(failoverUnknown, "error", err)
		}
		watches = append(watches, periodic.Service{Name: "relay-failover-watch", Interval: failoverCheckInterval,
			Tick: check, ErrorMessage: failoverUnknown})
	}
	waitWatches := periodic.Start(ctx, r.logger, watches...)
	var wg sync.WaitGroup
	for range r.cfg.InFlight {
		wg.Go(func() { r.loop(ctx) })
	}
	wg.Wait()
	cancel()
	waitWatches()
	return nil
}

// brokerOutageBackoff is how long a relay whose broker connection is down
// waits between tries: soon back after a blip, at most a few seconds
// behind the connection's own reconnect.
var brokerOutageBackoff = pipeline.Backoff{Initial: 200 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.2}

// loop is one of the relay's batches in flight: claim, publish, record,
// again; asleep when nothing is due.
func (r *Relay) loop(ctx context.Context) {
	outages := 0
	reach, _ := r.pub.(pipeline.Reachability)
	wait := false // for the position another relay's batch holds
	for {
		var res BatchResult
		var err error
		var held bool
		if reach != nil && outages > 0 {
			// After an outage, no row is taken (nor the position, which
			// every relay of the table needs) until the publisher says a
			// publish can get through: a silent broker would keep a batch
			// for the whole confirm timeout each time.
			err = reach.Reachable()
		}
		if err == nil {
			res, held, err = r.relayBatch(ctx, wait)
			wait = false
		} else {
			err = fmt.Errorf("%w (not tried: %v)", ErrBrokerUnreachable, err)
		}
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, ErrBrokerUnreachable) {
			// This relay's connection is down: it takes no more rows
			// until it is back (a relay that can reach the broker sends
			// them meanwhile), trying again after a growing wait that new
			// commits do not cut short.
			outages++
			wait := brokerOutageBackoff.Delay(outages)
			if outages == 1 || outages%10 == 0 {
				r.logger.Warn("relay cannot reach the broker; leaving the rows to relays that can", "batches_refused", outages, "next_try_in", wait, "error", err)
			}
			if pipeline.Sleep(ctx, wait) != nil {
				return
			}
			continue
		}
		if outages > 0 && res.Dispatched > 0 {
			// Back only once the broker confirmed a publish: a batch that
			// found nothing to send proves nothing.
			r.logger.Info("relay reaches the broker again", "batches_refused", outages)
			outages = 0
		}
		if err != nil {
			r.logger.Error("relay batch failed", "error", err)
		} else if res.Claimed > 0 || res.Passed > 0 {
			r.worked()
		}
		if err == nil && held && res.Claimed == 0 {
			// Another relay's batch holds the position and the slow lane
			// had nothing: wait for the position in the database, where a
			// lock wait costs nothing, rather than in probes, each of
			// which finds the rows that batch is sending and makes a claim
			// that cannot take them. Spinning so, two relays drained a
			// backlog at 0.74–1.00x of one relay's rate, four at
			// 0.49–0.66x: on two cores, the others' failed claims took the
			// mover's CPU.
			wait = true
			continue
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
// take (a commit nobody announced, a delay or backoff run out), or the
// claim's bound, whichever comes first. A probe that fails (the database
// gone) is not reported: the claim at the bound reports it.
//
// The probes are hot while the relay works (it found rows or was woken
// within hotFor): one every ProbeInterval, so that commits nobody announces
// (a program in another language, a plain INSERT) keep their latency under
// a steady load, and the claim's bound is PollInterval. Past hotFor they
// cool, spaced out doubling up to IdleProbeInterval, and the claim's
// bound becomes coldClaimInterval: an idle relay costs a snapshot read per
// IdleProbeInterval, where 100 probes and 2 claims a second cost an idle
// process and its PostgreSQL sessions 75–83 ms of CPU a second. Commits of
// Ferry's pools and wake-ups (CommitWatch, Waker, LISTEN) end the wait at
// once, hot or cold.
//
// Each probe asks the server's snapshot first (no table read, no plan):
// while it is the one the last full probe saw, no transaction that writes
// has begun or ended, so no row can have been committed since, and the
// pending index is not asked again (its probe plans an EXISTS over every
// weekly partition). Only a delay or a backoff running out makes a row due
// without a commit: the probe asks the index again once the earliest of
// those is due (nextDueAt, read again after each full probe).
func (r *Relay) idle(ctx context.Context) {
	args := pgx.NamedArgs{"topics": r.ordered}
	var (
		seen  string
		dueAt time.Time // zero: not read since the gate opened
		// Probes and skips since the gate opened: on a server other
		// clients keep writing to, the snapshot moves at nearly every
		// probe and asking it first only adds a query, so the gate rests
		// for gateRest when it skipped under a fifth of 10 probes or more.
		probes, skipped int
	)
	start, interval := time.Now(), r.cfg.ProbeInterval
	for {
		bound := r.cfg.PollInterval
		if r.hot() {
			interval = r.cfg.ProbeInterval
		} else {
			interval = max(min(2*interval, r.cfg.IdleProbeInterval), r.cfg.ProbeInterval)
			bound = max(coldClaimInterval, r.cfg.PollInterval)
		}
		left := time.Until(start.Add(bound))
		if left <= 0 || !r.sleep(ctx, min(interval, left)) {
			return
		}
		r.probes.Add(1)
		gate := time.Now().UnixNano() >= r.gateRestUntil.Load()
		if gate {
			if probes >= 10 && skipped*5 < probes {
				r.gateRestUntil.Store(time.Now().Add(gateRest).UnixNano())
				probes, skipped, dueAt, seen, gate = 0, 0, time.Time{}, "", false
			} else {
				probes++
			}
		}
		if gate {
			if dueAt.IsZero() {
				dueAt = r.nextDueAt(ctx)
			}
			var snap string
			if err := r.idleScan(ctx, currentSnapshotSQL, nil, &snap); err != nil {
				continue
			}
			if snap == seen && time.Now().Before(dueAt) {
				skipped++
				continue
			}
			seen = snap
		}
		var due bool
		if err := r.idleScan(ctx, r.probeSQL, []any{args}, &due); err == nil && due {
			return
		}
		if gate {
			// A commit since may have brought a delayed row.
			dueAt = r.nextDueAt(ctx)
		}
	}
}

// idleScan runs one row's query of the idle relay (the snapshot, the
// probe, the next due time) on a connection of its own, opened at first
// use and again after an error, and scans it into dest. Why not the pool:
// PostgreSQL plans a prepared statement afresh at each of its first five
// runs on a connection, and the probe's plan over every weekly partition
// took 6–12 ms to make, where running it takes 0.4; an idle relay's few
// probes a minute, spread over the pool's connections, were nearly all
// first runs (and each acquire of a connection idle for a second pings
// it first). On one connection, with generic plans forced (its plans
// depend on no parameter's value: now() prunes at run time), each
// statement is planned once.
func (r *Relay) idleScan(ctx context.Context, sql string, args []any, dest ...any) error {
	r.idleMu.Lock()
	defer r.idleMu.Unlock()
	if r.idleConn == nil {
		cfg := r.pool.Config().ConnConfig.Copy()
		cfg.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			return fmt.Errorf("connecting the idle relay's probes: %w", err)
		}
		r.idleConn = conn
	}
	err := r.idleConn.QueryRow(ctx, sql, args...).Scan(dest...)
	if err != nil {
		_ = r.idleConn.Close(context.WithoutCancel(ctx))
		r.idleConn = nil
	}
	return err
}

// closeIdleConn closes idleScan's connection.
func (r *Relay) closeIdleConn() {
	r.idleMu.Lock()
	defer r.idleMu.Unlock()
	if r.idleConn != nil {
		_ = r.idleConn.Close(context.Background())
		r.idleConn = nil
	}
}

// hotFor is how long after its last work (rows found, a wake-up) a relay
// keeps probing every ProbeInterval.
const hotFor = 2 * time.Second

// coldClaimInterval bounds how long a relay whose probes cooled goes
// without a claim: the claim reports a database the probes could not
// reach, at 4–5 ms of CPU each.
const coldClaimInterval = 30 * time.Second

// worked notes that the relay had work now (its probes stay hot).
func (r *Relay) worked() { r.busyAt.Store(time.Now().UnixNano()) }

// hot reports whether the relay worked within hotFor.
func (r *Relay) hot() bool { return time.Since(time.Unix(0, r.busyAt.Load())) < hotFor }

// gateRest is how long the probe's snapshot gate rests after it skipped
// fewer than a fifth of its probes. It counted idle rounds of PollInterval
// once; since a cooled round lasts 30 s, it is a time: 20 rounds of
// PollInterval were 10 s.
const gateRest = 10 * time.Second

// currentSnapshotSQL reads the server's snapshot: it changes when a
// transaction takes an id (its first write) or one that had an id ends.
const currentSnapshotSQL = `SELECT pg_current_snapshot()::text`

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
	next, err := r.NextDue(ctx)
	if err != nil {
		return r.cfg.PollInterval
	}
	return max(min(time.Until(next), r.cfg.PollInterval), time.Millisecond)
}

// NextDue says when the slow lane's earliest row (delayed, backed off) is
// due: a day ahead when it has none. A scheduler that runs RelayBatch
// itself (tenancy.Fleet) sleeps until then.
func (r *Relay) NextDue(ctx context.Context) (time.Time, error) {
	return r.readNextDue(func(dest ...any) error { return r.pool.QueryRow(ctx, r.nextDueSQL).Scan(dest...) })
}

// nextDueAt is when the slow lane's earliest row is due, read on the idle
// probes' connection: far ahead when it has none, now when the read fails
// (the probe then asks the index).
func (r *Relay) nextDueAt(ctx context.Context) time.Time {
	next, err := r.readNextDue(func(dest ...any) error { return r.idleScan(ctx, r.nextDueSQL, nil, dest...) })
	if err != nil {
		return time.Now()
	}
	return next
}

// readNextDue reads nextDueSQL through scan: the pool when probing is off
// (no connection of its own for the idle probes then), the idle probes'
// connection when on.
func (r *Relay) readNextDue(scan func(dest ...any) error) (time.Time, error) {
	var next *time.Time
	if err := scan(&next); err != nil {
		return time.Time{}, err
	}
	if next == nil {
		return time.Now().Add(24 * time.Hour), nil
	}
	return *next, nil
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

// Wake makes a sleeping relay look for work now. The LISTEN/NOTIFY
// listener calls it; so can a producer in the same process.
func (r *Relay) Wake() {
	r.worked()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}
