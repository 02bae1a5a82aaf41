package pgcdc

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// A streaming session: one replication connection from the slot's
// confirmed position, decoding the outbox's inserts into transactions
// (receive, decode), and the flights that relay them in order per
// aggregate (process), confirming the slot only past what the relay
// recorded.

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
