package pgcdc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// IDRelay relays outbox rows by id: *pgoutbox.Relay does.
type IDRelay interface {
	RelayIDs(ctx context.Context, ids []int64) (pgoutbox.BatchResult, error)
}

// HeartbeatPrefix is the prefix of the streamer's heartbeat messages
// (pg_logical_emit_message), which give an idle stream a position to confirm.
const HeartbeatPrefix = "ferry.cdc.heartbeat"

// statusMinInterval bounds how often a moved confirmed position is
// reported (the slot's position lags the relay by at most this much).
const statusMinInterval = 100 * time.Millisecond

// missingPatience is how long a row of the stream may stay invisible
// before it is taken as deleted.
const missingPatience = 2 * time.Second

// relayCallTimeout bounds one RelayIDs call. The call runs detached from
// the streamer's context, so that a stop does not cut a batch between the
// broker's confirm and the write that records it.
const relayCallTimeout = 30 * time.Second

// errStandby: another streamer uses the slot.
var errStandby = errors.New("the replication slot is in use by another streamer")

// Stats are a streamer's running state and totals.
type Stats struct {
	// Active: this process streams the slot (false: standing by, or
	// reconnecting).
	Active bool
	// Holding: the broker confirmed none of the last batch; the streamer
	// keeps its position and tries again.
	Holding bool
	// Confirmed is the flush position last reported to the server.
	Confirmed pglogrepl.LSN
	// Received is the furthest WAL position the stream has delivered.
	Received pglogrepl.LSN
	// Lag is how long ago the oldest transaction received and not yet
	// confirmed committed (0 when caught up).
	Lag time.Duration
	// Dispatched, Left and Skipped add up RelayIDs' results: published,
	// left to the polling relay, found already dispatched.
	Dispatched, Left, Skipped int64
	// SlotsCreated counts the slots this streamer had to create.
	SlotsCreated int64
	// PeakInFlight is the most RelayIDs calls that ran at once.
	PeakInFlight int64
	// Retried counts RelayIDs calls repeated for rows not yet visible.
	Retried int64
	// Missing counts rows of the stream never found in the table (deleted
	// before the stream reached them).
	Missing int64
	// Heartbeats counts the streamer's heartbeat messages that came back
	// through the stream.
	Heartbeats int64
	// Streamed counts transactions that arrived streamed while in progress
	// (larger than the server's logical_decoding_work_mem).
	Streamed int64
}

// Streamer streams the outbox's committed INSERTs from a logical
// replication slot to an IDRelay. See the package documentation for its
// rules.
type Streamer struct {
	pool   *pgxpool.Pool
	relay  IDRelay
	table  pgoutbox.Table
	cfg    Config
	logger *slog.Logger
	// Wake, if set, is called when a slot was (re)created, to have the
	// polling safety net look for the rows committed before it now.
	Wake func()

	slot, publication string
	nspname, relname  string
	database          string // the pool's, where the slot must decode
	// ordered is the relay's ordered topics; nil: every topic counts.
	ordered map[string]bool

	active, holding                  atomic.Bool
	confirmed, received              atomic.Uint64
	oldestUnconfirmed                atomic.Int64 // commit time, unix ns; 0: none
	dispatched, left, skipped, slots atomic.Int64
	streamed, heartbeats, missing    atomic.Int64
	retried, peakInFlight            atomic.Int64
	prepareMu                        sync.Mutex
	prepared                         bool
}

// NewStreamer returns a streamer of pool's outbox table (the relay's,
// pgoutbox.RelayConfig.Table) relaying through relay.
func NewStreamer(pool *pgxpool.Pool, relay IDRelay, table pgoutbox.Table, cfg Config, logger *slog.Logger) (*Streamer, error) {
	if pool == nil {
		return nil, errors.New("pgcdc: NewStreamer needs a pool")
	}
	if relay == nil {
		return nil, errors.New("pgcdc: NewStreamer needs a relay")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid CDC config: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	st := &Streamer{pool: pool, relay: relay, table: table, cfg: cfg, logger: logger.With("component", "cdc")}
	if o, ok := relay.(interface{ OrderedTopics() []string }); ok {
		st.ordered = map[string]bool{}
		for _, t := range o.OrderedTopics() {
			st.ordered[t] = true
		}
	}
	return st, nil
}

// Stats returns the streamer's state and totals.
func (s *Streamer) Stats() Stats {
	st := Stats{
		Active: s.active.Load(), Holding: s.holding.Load(),
		Confirmed: pglogrepl.LSN(s.confirmed.Load()), Received: pglogrepl.LSN(s.received.Load()),
		Dispatched: s.dispatched.Load(), Left: s.left.Load(), Skipped: s.skipped.Load(), SlotsCreated: s.slots.Load(),
		Streamed: s.streamed.Load(), Heartbeats: s.heartbeats.Load(), Missing: s.missing.Load(), Retried: s.retried.Load(), PeakInFlight: s.peakInFlight.Load(),
	}
	if t := s.oldestUnconfirmed.Load(); t != 0 {
		st.Lag = time.Since(time.Unix(0, t))
	}
	return st
}

// Slot is the slot's name (known once Prepare has run).
func (s *Streamer) Slot() string { return s.slot }

// Publication is the publication's name (known once Prepare has run).
func (s *Streamer) Publication() string { return s.publication }

// CheckServer reports whether the server can stream the outbox at all:
// wal_level=logical and PostgreSQL 14 or later. It changes nothing, so a
// process can call it before it migrates anything.
func CheckServer(ctx context.Context, pool *pgxpool.Pool) error {
	var walLevel string
	var version int
	if err := pool.QueryRow(ctx, `SELECT current_setting('wal_level'), current_setting('server_version_num')::int`).Scan(&walLevel, &version); err != nil {
		return fmt.Errorf("reading wal_level: %w", err)
	}
	if walLevel != "logical" {
		return fmt.Errorf("PostgreSQL's wal_level is %q; the CDC relay needs wal_level=logical (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)", walLevel)
	}
	if version < MinServerVersion {
		return fmt.Errorf("the CDC relay needs PostgreSQL 14 or later (pgoutput protocol 2), this server is %d", version)
	}
	return nil
}

// Prepare checks that the server can stream (wal_level=logical, PostgreSQL
// 14 or later, the outbox table exists) and creates the publication and
// the slot if they are missing. Run calls it; calling it first makes a
// misconfiguration fail the start instead of being retried.
func (s *Streamer) Prepare(ctx context.Context) error {
	s.prepareMu.Lock()
	defer s.prepareMu.Unlock()
	if s.prepared {
		return nil
	}
	if err := CheckServer(ctx, s.pool); err != nil {
		return err
	}
	if err := s.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&s.database); err != nil {
		return fmt.Errorf("reading the database's name: %w", err)
	}
	err := s.pool.QueryRow(ctx, `SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)`, s.table.Quoted()).
		Scan(&s.nspname, &s.relname)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("outbox table %s does not exist (run the migrate up command)", s.table.Quoted())
	}
	if err != nil {
		return fmt.Errorf("resolving outbox table %s: %w", s.table.Quoted(), err)
	}
	if s.slot, s.publication, err = Names(ctx, s.pool, s.cfg); err != nil {
		return err
	}
	if err := s.ensurePublication(ctx, s.table.Quoted()); err != nil {
		return err
	}
	// The slot is created here, not when streaming starts: a row committed
	// after Prepare returns is in its stream, so a caller that prepares
	// before taking traffic leaves nothing to the safety net.
	conn, err := s.replicationConn(ctx)
	if err != nil {
		return fmt.Errorf("opening replication connection (the role needs the REPLICATION attribute): %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := s.ensureSlot(ctx, conn); err != nil && !errors.Is(err, errStandby) {
		return err
	}
	s.prepared = true
	return nil
}

// ensurePublication creates the publication (inserts only) unless it
// exists, and refuses one that does not publish the outbox's inserts: it
// was made by someone else, and altering it is their call.
func (s *Streamer) ensurePublication(ctx context.Context, quotedTable string) error {
	for attempt := 0; ; attempt++ {
		var exists, hasTable, inserts, viaRoot, parted bool
		err := s.pool.QueryRow(ctx, `
			SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
			       EXISTS (SELECT 1 FROM pg_publication p WHERE p.pubname = $1 AND (p.puballtables OR EXISTS (
			           SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid = to_regclass($2)))),
			       COALESCE((SELECT pubinsert FROM pg_publication WHERE pubname = $1), false),
			       COALESCE((SELECT pubviaroot FROM pg_publication WHERE pubname = $1), false),
			       COALESCE((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($2)), false)`,
			s.publication, quotedTable).Scan(&exists, &hasTable, &inserts, &viaRoot, &parted)
		if err != nil {
			return fmt.Errorf("reading publication %s: %w", s.publication, err)
		}
		switch {
		case exists && hasTable && inserts && (viaRoot || !parted):
			return nil
		case exists && hasTable && inserts:
			// The outbox is partitioned (migration 00025): published
			// under its partitions' names, its inserts would not be
			// recognised as the outbox's.
			return fmt.Errorf("publication %s publishes %s.%s's partitions under their own names: ALTER PUBLICATION %s SET (publish_via_partition_root = true), or drop it (the cdc drop command)",
				s.publication, s.nspname, s.relname, pgx.Identifier{s.publication}.Sanitize())
		case exists:
			return fmt.Errorf("publication %s exists but does not publish the inserts of %s.%s: drop it (the cdc drop command) or name another (FERRY_CDC_PUBLICATION)",
				s.publication, s.nspname, s.relname)
		}
		_, err = s.pool.Exec(ctx, `CREATE PUBLICATION `+pgx.Identifier{s.publication}.Sanitize()+
			` FOR TABLE `+pgx.Identifier{s.nspname, s.relname}.Sanitize()+` WITH (publish = 'insert', publish_via_partition_root = true)`)
		var pgErr *pgconn.PgError
		// duplicate_object, or the catalog's unique_violation when two
		// processes create it at once: another process was first.
		if errors.As(err, &pgErr) && (pgErr.Code == "42710" || pgErr.Code == "23505") && attempt < 3 {
			continue
		}
		if err != nil {
			return fmt.Errorf("creating publication %s (needs ownership of the outbox table): %w", s.publication, err)
		}
		s.logger.Info("created publication", "publication", s.publication, "table", s.nspname+"."+s.relname)
		return nil
	}
}

// Run streams until ctx ends. A lost connection, a database or broker
// outage, a slot another process streams: each is waited out and retried,
// never an end; only a misconfiguration Prepare finds is returned.
func (s *Streamer) Run(ctx context.Context) error {
	for {
		err := s.Prepare(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) || !isConnectivity(err) {
			return err
		}
		s.logger.Warn("CDC relay cannot reach PostgreSQL; retrying", "error", err)
		if !sleep(ctx, time.Second) {
			return nil
		}
	}
	s.logger.Info("CDC relay started", "slot", s.slot, "publication", s.publication, "table", s.nspname+"."+s.relname, "batch_size", s.cfg.BatchSize)
	defer s.logger.Info("CDC relay stopped")
	standingBy := false
	for {
		err := s.stream(ctx)
		s.active.Store(false)
		if ctx.Err() != nil {
			return nil
		}
		pause := time.Second
		switch {
		case errors.Is(err, errStandby):
			if !standingBy {
				s.logger.Info("standing by: another CDC relay streams the slot; taking over when it stops", "slot", s.slot)
			}
			standingBy = true
			pause = s.cfg.StandbyRetry
		default:
			standingBy = false
			s.logger.Warn("CDC stream ended; reconnecting (what was not confirmed is streamed again)", "slot", s.slot, "error", err)
		}
		if !sleep(ctx, pause) {
			return nil
		}
	}
}

func isConnectivity(err error) bool {
	var cerr *pgconn.ConnectError
	return errors.As(err, &cerr) || pgconn.Timeout(err) || errors.Is(err, context.DeadlineExceeded)
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// replicationConn opens a walsender connection (replication=database) with
// the pool's settings, its application_name included (pg_stat_replication
// shows it; an operator terminating the process's sessions gets this one too).
func (s *Streamer) replicationConn(ctx context.Context) (*pgconn.PgConn, error) {
	cfg := s.pool.Config().ConnConfig.Config.Copy()
	cfg.RuntimeParams["replication"] = "database"
	return pgconn.ConnectConfig(ctx, cfg)
}

// ensureSlot creates the slot if it is missing, and replaces one PostgreSQL
// invalidated (wal_status lost). Rows committed before a new slot's start
// are not in its stream: they are pending in the outbox, so the polling
// safety net relays them; the log says so.
func (s *Streamer) ensureSlot(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.LSN, error) {
	st, err := ReadSlot(ctx, s.pool, s.slot)
	if err != nil {
		return 0, err
	}
	db := s.database
	switch {
	case st.Exists && (st.Plugin != "pgoutput" || st.Database != db):
		return 0, fmt.Errorf("replication slot %s exists for plugin %q on database %q, not pgoutput on %q: name another (FERRY_CDC_SLOT)", s.slot, st.Plugin, st.Database, db)
	case st.Exists && st.Active:
		return 0, errStandby
	case st.Exists && st.WALStatus == "lost":
		s.logger.Warn("replication slot was invalidated (max_slot_wal_keep_size): dropping and recreating it; the polling safety net relays what it missed", "slot", s.slot)
		if _, err := conn.Exec(ctx, "DROP_REPLICATION_SLOT "+s.slot).ReadAll(); err != nil {
			return 0, fmt.Errorf("dropping lost replication slot %s: %w", s.slot, err)
		}
	case st.Exists:
		lsn, err := pglogrepl.ParseLSN(st.ConfirmedLSN)
		if err != nil {
			return 0, fmt.Errorf("replication slot %s's confirmed position %q: %w", s.slot, st.ConfirmedLSN, err)
		}
		return lsn, nil
	}
	res, err := pglogrepl.CreateReplicationSlot(ctx, conn, s.slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{SnapshotAction: "NOEXPORT_SNAPSHOT", Mode: pglogrepl.LogicalReplication})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" { // another streamer created it meanwhile
		return 0, errStandby
	}
	if err != nil {
		return 0, fmt.Errorf("creating replication slot %s (needs the REPLICATION attribute): %w", s.slot, err)
	}
	s.slots.Add(1)
	lsn, err := pglogrepl.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return 0, fmt.Errorf("replication slot %s's start %q: %w", s.slot, res.ConsistentPoint, err)
	}
	// Only for the log line: a count that fails leaves it at 0.
	pending, _ := s.table.PendingCount(ctx, s.pool)
	log := s.logger.Info
	if pending > 0 {
		log = s.logger.Warn
	}
	log("created replication slot: rows committed before it are not in its stream; the polling safety net relays those still pending",
		"slot", s.slot, "start_lsn", lsn, "pending_rows", pending)
	if s.Wake != nil {
		s.Wake()
	}
	return lsn, nil
}
