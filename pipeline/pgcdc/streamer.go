package pgcdc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
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

// txn is one committed transaction's outbox rows, in commit order.
type txn struct {
	ids []int64
	// keys[i] is the aggregate whose order ids[i] must keep ("" for a row
	// of an unordered topic): batches in flight at once share none.
	keys       []string
	end        pglogrepl.LSN
	commitTime time.Time
}

// session is one replication connection's streaming state.
type session struct {
	s       *Streamer
	conn    *pgconn.PgConn
	queue   chan txn
	pending atomic.Int64 // transactions queued or being relayed
	// lastSent is the flush position last reported.
	lastSent     pglogrepl.LSN
	lastStatusAt time.Time
	relations    map[uint32]outboxColumns // relation id -> where the outbox's columns are; id -1: not the outbox
	inStream     bool
	streamXid    uint32 // the top-level transaction of the stream block being read
	cur          *txn
	streams      map[uint32][]streamedRow // top-level xid -> rows of its in-progress stream
}

type streamedRow struct {
	subxid uint32
	id     int64
	key    string
}

// outboxColumns locates the outbox's columns in a relation's tuples.
type outboxColumns struct{ id, topic, aggregate int }

// stream runs one replication session until it fails or ctx ends.
func (s *Streamer) stream(ctx context.Context) error {
	conn, err := s.replicationConn(ctx)
	if err != nil {
		return fmt.Errorf("opening replication connection: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	start, err := s.ensureSlot(ctx, conn)
	if err != nil {
		return err
	}
	err = pglogrepl.StartReplication(ctx, conn, s.slot, 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		PluginArgs: []string{
			"proto_version '2'",
			"publication_names '" + s.publication + "'", // a validated name: [a-z0-9_]
			"messages 'true'",
			"streaming 'true'",
		},
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use
		return errStandby
	}
	if err != nil {
		return fmt.Errorf("starting replication from slot %s: %w", s.slot, err)
	}
	s.confirmed.Store(uint64(start))
	s.received.Store(uint64(start))
	s.active.Store(true)
	s.logger.Info("streaming", "slot", s.slot, "from_lsn", start)

	se := &session{s: s, conn: conn, queue: make(chan txn, 64), lastSent: start, lastStatusAt: time.Now(),
		relations: map[uint32]outboxColumns{}, streams: map[uint32][]streamedRow{}}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	procErr := make(chan error, 1)
	wg.Go(func() { procErr <- se.process(sctx) })
	wg.Go(func() { se.heartbeat(sctx) })
	err = se.receive(sctx, procErr)
	cancel()
	wg.Wait()
	// The last confirmed position, so that the next streamer replays as
	// little as possible (best effort). Not on a connection pgconn has
	// closed after a read error: its closing goroutine is writing to the
	// socket (a data race, seen under -race during a database failover).
	if !conn.IsClosed() {
		_ = se.sendStatus(true)
	}
	s.oldestUnconfirmed.Store(0)
	return err
}

// heartbeat writes a logical decoding message whenever the stream has been
// idle for HeartbeatInterval, so that the slot gets a position past
// unrelated WAL to confirm.
func (se *session) heartbeat(ctx context.Context) {
	t := time.NewTicker(se.s.cfg.HeartbeatInterval)
	defer t.Stop()
	warned := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if se.pending.Load() != 0 {
			continue
		}
		if _, err := se.s.pool.Exec(ctx, `SELECT pg_logical_emit_message(false, $1, '')`, HeartbeatPrefix); err != nil && ctx.Err() == nil && !warned {
			warned = true
			se.s.logger.Warn("CDC heartbeat failed: an idle slot retains WAL until the outbox gets a row", "error", err)
		}
	}
}

// receive reads the stream (it alone uses conn), queues committed
// transactions for process and reports the confirmed position.
func (se *session) receive(ctx context.Context, procErr <-chan error) error {
	s := se.s
	for {
		select {
		case err := <-procErr:
			return err
		default:
		}
		if err := se.sendStatus(false); err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 250*time.Millisecond)
		raw, err := se.conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receiving from the replication stream: %w", err)
		}
		switch m := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("replication stream: %w", pgconn.ErrorResponseToPgError(m))
		case *pgproto3.CopyData:
			if len(m.Data) == 0 {
				continue
			}
			switch m.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				k, err := pglogrepl.ParsePrimaryKeepaliveMessage(m.Data[1:])
				if err != nil {
					return fmt.Errorf("parsing keepalive: %w", err)
				}
				se.idleAdvance(k.ServerWALEnd)
				if k.ReplyRequested {
					if err := se.sendStatus(true); err != nil {
						return err
					}
				}
			case pglogrepl.XLogDataByteID:
				x, err := pglogrepl.ParseXLogData(m.Data[1:])
				if err != nil {
					return fmt.Errorf("parsing XLogData: %w", err)
				}
				if x.WALStart > pglogrepl.LSN(s.received.Load()) {
					s.received.Store(uint64(x.WALStart))
				}
				if err := se.decode(ctx, x.WALData, procErr); err != nil {
					return err
				}
			}
		}
	}
}

// idleAdvance confirms lsn, a position the server reached with nothing
// for us before it, when nothing received is still being relayed and no
// transaction is half received.
func (se *session) idleAdvance(lsn pglogrepl.LSN) {
	if se.cur != nil || se.pending.Load() != 0 {
		return
	}
	se.s.confirm(lsn)
}

// confirm moves the confirmed position forward to lsn (never back).
func (s *Streamer) confirm(lsn pglogrepl.LSN) {
	for {
		old := s.confirmed.Load()
		if uint64(lsn) <= old || s.confirmed.CompareAndSwap(old, uint64(lsn)) {
			return
		}
	}
}

// sendStatus reports the confirmed position when it moved, and every
// StatusInterval regardless. The flush (and apply) position is always the
// confirmed one, set explicitly: pglogrepl would put the write position in
// a zero flush position, and the write position is only what was received.
func (se *session) sendStatus(force bool) error {
	s := se.s
	c := pglogrepl.LSN(s.confirmed.Load())
	if c == 0 {
		return nil
	}
	since := time.Since(se.lastStatusAt)
	// A moved position is reported at most every statusMinInterval: the
	// server may write the slot's state to disk on each report that moves
	// its restart position, which under load would be a write per batch.
	if !force && since < s.cfg.StatusInterval && (c == se.lastSent || since < statusMinInterval) {
		return nil
	}
	write := max(pglogrepl.LSN(s.received.Load()), c)
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), se.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: write, WALFlushPosition: c, WALApplyPosition: c,
	})
	if err != nil {
		return fmt.Errorf("sending standby status: %w", err)
	}
	se.lastSent, se.lastStatusAt = c, time.Now()
	return nil
}

// decode handles one pgoutput message.
func (se *session) decode(ctx context.Context, data []byte, procErr <-chan error) error {
	msg, err := pglogrepl.ParseV2(data, se.inStream)
	if err != nil {
		return fmt.Errorf("parsing pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessageV2:
		cols := outboxColumns{id: -1, topic: -1, aggregate: -1}
		if m.Namespace == se.s.nspname && m.RelationName == se.s.relname {
			for i, c := range m.Columns {
				switch c.Name {
				case "id":
					cols.id = i
				case "topic":
					cols.topic = i
				case "aggregate_id":
					cols.aggregate = i
				}
			}
			if cols.id < 0 || cols.topic < 0 || cols.aggregate < 0 {
				return fmt.Errorf("outbox table %s.%s lacks id, topic or aggregate_id in the stream", m.Namespace, m.RelationName)
			}
		}
		se.relations[m.RelationID] = cols
	case *pglogrepl.BeginMessage:
		se.cur = &txn{}
	case *pglogrepl.InsertMessageV2:
		cols, ok := se.relations[m.RelationID]
		if !ok {
			return fmt.Errorf("insert into relation %d before its relation message", m.RelationID)
		}
		if cols.id < 0 {
			return nil
		}
		id, err := rowID(m.Tuple, cols.id)
		if err != nil {
			return err
		}
		key := se.s.orderKey(m.Tuple, cols)
		if se.inStream {
			// m.Xid is the (sub)transaction that inserted the row.
			se.streams[se.streamXid] = append(se.streams[se.streamXid], streamedRow{subxid: m.Xid, id: id, key: key})
			return nil
		}
		if se.cur == nil {
			return errors.New("insert outside a transaction in the replication stream")
		}
		se.cur.ids = append(se.cur.ids, id)
		se.cur.keys = append(se.cur.keys, key)
	case *pglogrepl.CommitMessage:
		if se.cur == nil {
			return errors.New("commit without begin in the replication stream")
		}
		t := *se.cur
		t.end, t.commitTime = m.TransactionEndLSN, m.CommitTime
		se.cur = nil
		return se.enqueue(ctx, t, procErr)
	case *pglogrepl.StreamStartMessageV2:
		se.inStream, se.streamXid = true, m.Xid
		if _, ok := se.streams[m.Xid]; !ok {
			se.streams[m.Xid] = nil
		}
	case *pglogrepl.StreamStopMessageV2:
		se.inStream = false
	case *pglogrepl.StreamAbortMessageV2:
		rows := se.streams[m.Xid]
		if m.SubXid == m.Xid {
			delete(se.streams, m.Xid)
			return nil
		}
		kept := rows[:0]
		for _, r := range rows {
			if r.subxid != m.SubXid {
				kept = append(kept, r)
			}
		}
		se.streams[m.Xid] = kept
	case *pglogrepl.StreamCommitMessageV2:
		rows := se.streams[m.Xid]
		delete(se.streams, m.Xid)
		se.s.streamed.Add(1)
		t := txn{ids: make([]int64, len(rows)), keys: make([]string, len(rows)), end: m.TransactionEndLSN, commitTime: m.CommitTime}
		for i, r := range rows {
			t.ids[i], t.keys[i] = r.id, r.key
		}
		return se.enqueue(ctx, t, procErr)
	case *pglogrepl.LogicalDecodingMessageV2:
		if !m.Transactional && m.Prefix == HeartbeatPrefix {
			se.s.heartbeats.Add(1)
			se.idleAdvance(m.LSN)
		}
	}
	return nil
}

// orderKey is the aggregate of an inserted row if its topic is ordered
// ("" otherwise). Without the relay's ordered topics every row counts as
// ordered: batches in flight then never share an aggregate at all.
func (s *Streamer) orderKey(t *pglogrepl.TupleData, cols outboxColumns) string {
	text := func(i int) string {
		if t == nil || i >= len(t.Columns) || t.Columns[i].DataType != pglogrepl.TupleDataTypeText {
			return ""
		}
		return string(t.Columns[i].Data)
	}
	if s.ordered != nil && !s.ordered[text(cols.topic)] {
		return ""
	}
	// The NUL keeps "" (unordered) apart from an empty aggregate id.
	return "\x00" + text(cols.aggregate)
}

// rowID reads the id column of an inserted row.
func rowID(t *pglogrepl.TupleData, idx int) (int64, error) {
	if t == nil || idx >= len(t.Columns) {
		return 0, errors.New("outbox insert without its id column in the stream")
	}
	c := t.Columns[idx]
	if c.DataType != pglogrepl.TupleDataTypeText {
		return 0, fmt.Errorf("outbox id column sent as %q, want text", c.DataType)
	}
	id, err := strconv.ParseInt(string(c.Data), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("outbox id %q in the stream: %w", c.Data, err)
	}
	return id, nil
}

// enqueue hands a committed transaction to process, reporting status while
// it waits: a streamer held by a broker outage stays connected.
func (se *session) enqueue(ctx context.Context, t txn, procErr <-chan error) error {
	se.pending.Add(1)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case se.queue <- t:
			return nil
		case err := <-procErr:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			if err := se.sendStatus(false); err != nil {
				return err
			}
		}
	}
}

// flight is one RelayIDs call's worth of rows.
type flight struct {
	ids  []int64
	keys map[string]bool // the ordered aggregates among ids
	// end is the position confirmed once this flight and every earlier
	// one are done: its group's end, on the group's last flight only.
	end   pglogrepl.LSN
	txns  int // transactions the flight completes (on the last flight)
	first time.Time
	done  chan struct{}
	err   error
}

// process relays queued transactions in commit order: several small ones
// in one RelayIDs call, a large one in BatchSize calls, up to InFlight
// calls at once, which never share an ordered aggregate, so each
// aggregate's rows still go out one call after the other. The confirmed
// position moves to a transaction's end once it and everything before it
// is relayed.
func (se *session) process(ctx context.Context) error {
	s := se.s
	var flying, waiting []*flight // flying: started, in commit order; waiting: not yet
	finished := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	active := func() (n int, keys map[string]bool) {
		keys = map[string]bool{}
		for _, f := range flying {
			select {
			case <-f.done:
			default:
				n++
				for k := range f.keys {
					keys[k] = true
				}
			}
		}
		return n, keys
	}
	for {
		// Confirm, in order, what is done.
		for len(flying) > 0 {
			f := flying[0]
			if !isDone(f) {
				break
			}
			if f.err != nil {
				return nil // stopping: what is not confirmed is streamed again
			}
			if f.end != 0 {
				s.confirm(f.end)
			}
			se.pending.Add(-int64(f.txns))
			flying = flying[1:]
		}
		// Start what may start.
		for len(waiting) > 0 {
			n, keys := active()
			f := waiting[0]
			if n >= s.cfg.InFlight || shares(f.keys, keys) {
				break
			}
			waiting = waiting[1:]
			flying = append(flying, f)
			if int64(n+1) > s.peakInFlight.Load() {
				s.peakInFlight.Store(int64(n + 1))
			}
			wg.Go(func() {
				f.err = s.relayHolding(ctx, f.ids)
				close(f.done)
				select {
				case finished <- struct{}{}:
				default:
				}
			})
		}
		switch {
		case len(flying) > 0:
			s.oldestUnconfirmed.Store(flying[0].first.UnixNano())
		case len(waiting) > 0:
			s.oldestUnconfirmed.Store(waiting[0].first.UnixNano())
		default:
			s.oldestUnconfirmed.Store(0)
		}
		var queue <-chan txn
		if len(waiting) == 0 {
			queue = se.queue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-finished:
		case t := <-queue:
			waiting = append(waiting, s.flights(se.gather(t))...)
		}
	}
}

func isDone(f *flight) bool {
	select {
	case <-f.done:
		return true
	default:
		return false
	}
}

func shares(a, b map[string]bool) bool {
	for k := range a {
		if b[k] {
			return true
		}
	}
	return false
}

// gather adds to t the transactions already queued, up to BatchSize rows.
func (se *session) gather(t txn) []txn {
	group := []txn{t}
	n := len(t.ids)
	for n < se.s.cfg.BatchSize {
		select {
		case t := <-se.queue:
			group = append(group, t)
			n += len(t.ids)
		default:
			return group
		}
	}
	return group
}

// flights cuts a group of transactions into calls of at most BatchSize rows.
func (s *Streamer) flights(group []txn) []*flight {
	var ids []int64
	var keys []string
	for _, t := range group {
		ids = append(ids, t.ids...)
		keys = append(keys, t.keys...)
	}
	var out []*flight
	for start := 0; start < len(ids) || start == 0; start += s.cfg.BatchSize {
		end := min(len(ids), start+s.cfg.BatchSize)
		f := &flight{ids: ids[start:end], keys: map[string]bool{}, first: group[0].commitTime, done: make(chan struct{})}
		for _, k := range keys[start:end] {
			if k != "" {
				f.keys[k] = true
			}
		}
		out = append(out, f)
		if end == len(ids) {
			break
		}
	}
	last := out[len(out)-1]
	last.end, last.txns = group[len(group)-1].end, len(group)
	return out
}

// relayHolding relays ids, trying again (the position held) while the
// broker confirms nothing or the database fails, and asking again for rows
// not found: the stream can deliver a commit a moment before it is
// visible to other sessions. A row still missing after missingPatience is
// taken as deleted (a replay after retention pruned it, say): if it ever
// shows up pending, the polling safety net has it. It returns only when
// done or when ctx ends.
func (s *Streamer) relayHolding(ctx context.Context, ids []int64) error {
	backoff := holdBackoffMin
	var since, lastLog, missingSince time.Time
	missingWait := time.Millisecond
	for {
		callCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), relayCallTimeout)
		res, err := s.relay.RelayIDs(callCtx, ids)
		cancel()
		if err == nil {
			s.dispatched.Add(int64(res.Dispatched))
			s.left.Add(int64(res.Left + res.Failed))
			s.skipped.Add(int64(res.Skipped))
			if s.holding.Swap(false) {
				s.logger.Info("CDC relay resumed", "slot", s.slot, "held_for", time.Since(since).Round(time.Millisecond))
			}
			if len(res.Missing) == 0 {
				return nil
			}
			if missingSince.IsZero() {
				missingSince = time.Now()
			}
			if time.Since(missingSince) >= missingPatience {
				s.missing.Add(int64(len(res.Missing)))
				s.logger.Warn("outbox rows of the stream not found in the table: taken as deleted", "slot", s.slot, "ids", res.Missing)
				return nil
			}
			ids = res.Missing
			s.retried.Add(1)
			if !sleep(ctx, missingWait) {
				return ctx.Err()
			}
			missingWait = min(2*missingWait, 100*time.Millisecond)
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !s.holding.Swap(true) {
			since = time.Now()
		}
		if time.Since(lastLog) >= 30*time.Second {
			lastLog = time.Now()
			s.logger.Warn("CDC relay holding its position: trying the same rows again", "slot", s.slot,
				"confirmed_lsn", pglogrepl.LSN(s.confirmed.Load()), "rows", len(ids), "error", err)
		}
		if !sleep(ctx, backoff) {
			return ctx.Err()
		}
		backoff = min(2*backoff, holdBackoffMax)
	}
}
