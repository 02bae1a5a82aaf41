// Package pgstatus answers "is the pipeline healthy, and if not, why":
// the outbox backlog per topic, its oldest due row, the rows that keep
// failing with their last error, the durable retries waiting for their
// handler (with why), the poison store's depth, and which relay and
// consumer processes are alive (their heartbeats in ferry_instances).
package pgstatus

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpause"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
)

// Defaults.
const (
	DefaultHeartbeatInterval = 5 * time.Second
	// AliveWithin is how recent a heartbeat must be for its process to count as alive.
	AliveWithin = 3 * DefaultHeartbeatInterval
	// DefaultAttemptsThreshold is the article's alert threshold: rows tried more often are listed.
	DefaultAttemptsThreshold = 5
)

// TopicBacklog is one topic's undispatched rows.
type TopicBacklog = pgoutbox.TopicBacklog

// FailingRow is an undispatched row tried more than the threshold.
type FailingRow = pgoutbox.TriedRow

// RetryGroup is the durable retries waiting for one handler with one
// error fingerprint: messages a handler failed, rescheduled through the
// outbox (topic ferry.retry) to be delivered to it again.
type RetryGroup = pgoutbox.RetryGroup

// Instance is one Ferry process.
type Instance struct {
	ID          string    `json:"instance_id"`
	Components  string    `json:"components"`
	Hostname    string    `json:"hostname"`
	PID         int       `json:"pid"`
	Version     string    `json:"version"`
	StartedAt   time.Time `json:"started_at"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	Alive       bool      `json:"alive"`
}

// Report is the pipeline's status.
type Report struct {
	At            time.Time      `json:"at"`
	Backlog       []TopicBacklog `json:"backlog"`
	PendingTotal  int            `json:"pending_total"`
	OldestDueAgeS float64        `json:"oldest_due_age_seconds"`
	// FailingCount is how many rows the relay tried to publish and could
	// not (pgoutbox.StateFailing): the number the console's overview and
	// failing page show.
	FailingCount      int `json:"failing_count"`
	AttemptsThreshold int `json:"attempts_threshold"`
	// Failing are the failing rows tried more than AttemptsThreshold times
	// (at most 20, the most tried first): the ones that need a human.
	Failing []FailingRow `json:"failing"`
	// Retrying are the durable retries waiting, grouped by handler and
	// error fingerprint (at most 20 groups), and how many in all.
	Retrying      []RetryGroup `json:"retrying"`
	RetryingTotal int          `json:"retrying_total"`
	// Held are the ordered partitions waiting behind a failing head.
	Held []pgheld.Partition `json:"held_partitions"`
	// Paused are the handlers an operator paused (pgpause): their
	// messages wait until they are resumed.
	Paused []pgpause.Pause `json:"paused_handlers"`
	// Versions count the events still to be read (pending, retrying,
	// poisoned) by topic and schema version: when an old version is gone
	// from here (and from the archive a replay would read), its upcast
	// step may be deleted.
	Versions    []StoredVersion `json:"schema_versions"`
	Poison      map[string]int  `json:"poison"`
	PoisonTotal int             `json:"poison_total"`
	// PoisonAcknowledged is the last `ferry status --acknowledge`, nil if
	// none; PoisonNew counts the messages poisoned since (all of them
	// without one). Only those need a human.
	PoisonAcknowledged *Acknowledgment `json:"poison_acknowledged,omitempty"`
	PoisonNew          int             `json:"poison_new"`
	Instances          []Instance      `json:"instances"`
	RelaysAlive        int             `json:"relays_alive"`
	ConsumersAlive     int             `json:"consumers_alive"`
	// OutboxPartitions are the outbox's weekly partitions (migration
	// 00025); empty when the table is not partitioned.
	OutboxPartitions []pgweeks.Partition `json:"outbox_partitions"`
	// LedgerPartitions are the consumers' ledger's (migration 00026).
	LedgerPartitions []pgweeks.Partition `json:"ledger_partitions"`
}

// Collect builds the report for the outbox table t; failing lists at most
// 20 rows with more than threshold attempts.
func Collect(ctx context.Context, pool *pgxpool.Pool, t pgoutbox.Table, threshold int) (Report, error) {
	rep := Report{AttemptsThreshold: threshold}
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&rep.At); err != nil {
		return rep, fmt.Errorf("reading status: %w", err)
	}
	backlog, err := t.Backlog(ctx, pool)
	if err != nil {
		return rep, err
	}
	rep.Backlog = backlog
	for _, b := range backlog {
		rep.PendingTotal += b.Pending
		rep.OldestDueAgeS = max(rep.OldestDueAgeS, b.OldestDueAgeS)
	}
	if rep.FailingCount, err = t.CountFailing(ctx, pool); err != nil {
		return rep, err
	}
	if rep.Failing, err = t.MostTried(ctx, pool, threshold, 20); err != nil {
		return rep, err
	}
	if rep.Retrying, rep.RetryingTotal, err = t.RetryGroups(ctx, pool, 20); err != nil {
		return rep, err
	}
	if rep.Paused, err = pgpause.List(ctx, pool); err != nil {
		return rep, err
	}
	if rep.Held, err = pgheld.List(ctx, pool); err != nil {
		return rep, err
	}
	if rep.Versions, err = StoredVersions(ctx, pool, t); err != nil {
		return rep, err
	}
	if rep.Poison, err = pgpoison.Depth(ctx, pool); err != nil {
		return rep, err
	}
	for _, n := range rep.Poison {
		rep.PoisonTotal += n
	}
	if rep.PoisonAcknowledged, err = lastAcknowledgment(ctx, pool); err != nil {
		return rep, err
	}
	// Without an acknowledgment every message is new: the total counted
	// above, without counting the store a second time.
	rep.PoisonNew = rep.PoisonTotal
	if rep.PoisonAcknowledged != nil {
		if _, rep.PoisonNew, err = pgpoison.Since(ctx, pool, rep.PoisonAcknowledged.MaxID); err != nil {
			return rep, err
		}
	}
	if rep.Instances, err = Instances(ctx, pool); err != nil {
		return rep, err
	}
	if rep.OutboxPartitions, _, err = t.Partitions(ctx, pool); err != nil {
		return rep, err
	}
	if rep.LedgerPartitions, _, err = pgledger.Partitions(ctx, pool); err != nil {
		return rep, err
	}
	for _, in := range rep.Instances {
		if !in.Alive {
			continue
		}
		if strings.Contains(in.Components, "relay") {
			rep.RelaysAlive++
		}
		if strings.Contains(in.Components, "consumers") {
			rep.ConsumersAlive++
		}
	}
	return rep, nil
}

// AcknowledgeAction is the audit log's action of an acknowledgment.
const AcknowledgeAction = "status.acknowledge"

// Acknowledgment says that someone saw the poison store as it was: its
// messages up to MaxID no longer need a human, the later ones do.
type Acknowledgment struct {
	By    string    `json:"by"`
	At    time.Time `json:"at"`
	MaxID int64     `json:"max_id"`
	Count int       `json:"count"`
}

// Acknowledge records, in the audit log, that actor saw the poison store
// as it is now (`ferry status --acknowledge`).
func Acknowledge(ctx context.Context, pool *pgxpool.Pool, actor string) (Acknowledgment, error) {
	maxID, n, err := pgpoison.Since(ctx, pool, 0)
	if err != nil {
		return Acknowledgment{}, err
	}
	if err := pgaudit.Record(ctx, pool, pgaudit.Entry{Actor: actor, Action: AcknowledgeAction, Scope: "poison store", Count: n,
		Detail: map[string]any{"poison_max_id": maxID}}); err != nil {
		return Acknowledgment{}, err
	}
	return Acknowledgment{By: actor, At: time.Now(), MaxID: maxID, Count: n}, nil
}

func lastAcknowledgment(ctx context.Context, pool *pgxpool.Pool) (*Acknowledgment, error) {
	e, err := pgaudit.Latest(ctx, pool, AcknowledgeAction)
	if err != nil || e == nil {
		return nil, err
	}
	maxID, _ := e.Detail["poison_max_id"].(float64)
	return &Acknowledgment{By: e.Actor, At: e.At, MaxID: int64(maxID), Count: e.Count}, nil
}

// Instances returns the Ferry processes registered in ferry_instances,
// oldest first, each alive when its heartbeat is recent (AliveWithin).
func Instances(ctx context.Context, pool *pgxpool.Pool) ([]Instance, error) {
	rows, err := pool.Query(ctx, `SELECT instance_id, components, hostname, pid, version, started_at, heartbeat_at,
		heartbeat_at > now() - $1 * interval '1 microsecond' FROM ferry_instances ORDER BY started_at`, AliveWithin.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("reading instances: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Instance])
}

// EarlierRelaysAlive says whether a relay of a version before migration
// 00024 is alive (its heartbeat recent, its row without relay_lanes): one
// that takes every row without dispatched_at for pending, so that this
// version's relays must mark each row they send while it runs
// (pgoutbox.RelayConfig.MarkEachRow).
func EarlierRelaysAlive(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	var alive bool
	err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM ferry_instances
		WHERE NOT relay_lanes AND components LIKE '%relay%' AND heartbeat_at > now() - $1 * interval '1 microsecond')`, AliveWithin.Microseconds()).Scan(&alive)
	if err != nil {
		return false, fmt.Errorf("looking for relays of an earlier version: %w", err)
	}
	return alive, nil
}

// Heartbeat keeps one process's row in ferry_instances fresh.
type Heartbeat struct {
	pool       *pgxpool.Pool
	id         string
	components string
	host       string
	version    string
	// Counters, if set, is sampled into ferry_samples every
	// SampleInterval, for the console's charts. Set it before Run.
	Counters   func() Counters
	lastSample time.Time
}

// upsertInstance says relay_lanes: this version's relays pass rows
// without marking each (migration 00024).
const upsertInstance = `INSERT INTO ferry_instances (instance_id, components, hostname, pid, version, relay_lanes)
	VALUES ($1, $2, $3, $4, $5, true)
	ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = now()`

// NewHeartbeat registers a process running components.
func NewHeartbeat(ctx context.Context, pool *pgxpool.Pool, id string, components []string, version string) (*Heartbeat, error) {
	if pool == nil || id == "" {
		return nil, errors.New("pgstatus: NewHeartbeat needs a pool and an id")
	}
	host, _ := os.Hostname()
	h := &Heartbeat{pool: pool, id: id, components: strings.Join(components, ","), host: host, version: version}
	if err := h.beat(ctx); err != nil {
		return nil, fmt.Errorf("registering instance: %w", err)
	}
	return h, nil
}

// ID is the process's instance id.
func (h *Heartbeat) ID() string { return h.id }

// StaleRetention is how long the row of a process that died without
// deregistering stays in ferry_instances (shown as DEAD by status, counted
// as stale by the metrics and alerted on) before a live process removes it.
const StaleRetention = time.Hour

// beat upserts, so that a row pruned by hand (or lost with a restored
// database) comes back on the next beat, and removes the rows of processes
// dead for longer than StaleRetention.
func (h *Heartbeat) beat(ctx context.Context) error {
	b := &pgx.Batch{}
	b.Queue(upsertInstance, h.id, h.components, h.host, os.Getpid(), h.version)
	b.Queue(`DELETE FROM ferry_instances WHERE heartbeat_at < now() - $1 * interval '1 microsecond'`, StaleRetention.Microseconds())
	return h.pool.SendBatch(ctx, b).Close()
}

// Run beats every interval until ctx ends, then deletes the row: a clean
// stop is not a death.
func (h *Heartbeat) Run(ctx context.Context, interval time.Duration) {
	h.Service(interval).Run(ctx, nil)
}

// Service is the heartbeat as a background service: a beat and a sample
// of the counters every interval (the sample at start is the base the
// first difference is taken from); the row is deleted once ctx ends. A
// missed beat shows as staleness in ferry status, and is logged.
func (h *Heartbeat) Service(interval time.Duration) periodic.Service {
	if interval <= 0 {
		interval = DefaultHeartbeatInterval
	}
	started := false
	return periodic.Service{Name: "heartbeat", Interval: interval, Immediate: true,
		ErrorMessage: "heartbeat failed: this process shows as stale in ferry status",
		Tick: func(ctx context.Context) error {
			if !started {
				started = true // NewHeartbeat beat already
				h.sample(ctx)
				return nil
			}
			err := h.beat(ctx)
			h.sample(ctx)
			return err
		},
		Stop: func(ctx context.Context) {
			_, _ = h.pool.Exec(ctx, `DELETE FROM ferry_instances WHERE instance_id = $1`, h.id) // gone either way: StaleRetention removes it
		}}
}
