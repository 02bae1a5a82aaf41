package app

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// Written by hand: net/http bounds each connection's time (ReadHeaderTimeout,
// ReadTimeout) but not who holds the server's slots, and netutil's
// LimitListener refuses newcomers while slow clients hold every slot. A
// client that opens connections and sends nothing (or half a header, or a
// body announced and never sent) would keep the API and /readyz away from
// everyone else for as long as those timeouts.

// connGuard is a server's listener. It bounds the connections held at
// once, in all (max) and per client address (perClient). At a bound it
// makes room by closing the connection that has waited longest without a
// request in progress (one still to send its first header, or idle between
// requests) instead of refusing the newcomer: a real client sends its
// header at once and is then no longer evictable, so slots held by clients
// that send nothing go to those that do. Only when every slot carries a
// request in progress does a newcomer wait (up to a second) and then get
// closed.
type connGuard struct {
	net.Listener
	max, perClient int

	mu      sync.Mutex
	conns   map[net.Conn]*guarded
	changed chan struct{} // closed and replaced when a slot may have freed
}

type guarded struct {
	client string
	busy   bool      // a request in progress: not evictable
	since  time.Time // when it last became evictable
}

func newConnGuard(ln net.Listener, max, perClient int) *connGuard {
	return &connGuard{Listener: ln, max: max, perClient: perClient, conns: map[net.Conn]*guarded{}, changed: make(chan struct{})}
}

// admitWait bounds how long a newcomer waits when every slot is busy.
const admitWait = time.Second

func (g *connGuard) Accept() (net.Conn, error) {
	for {
		c, err := g.Listener.Accept()
		if err != nil {
			return nil, err
		}
		client := clientOf(c.RemoteAddr())
		deadline := time.Now().Add(admitWait)
		for {
			g.mu.Lock()
			ok := g.admit(client)
			if ok {
				g.conns[c] = &guarded{client: client, since: time.Now()}
			}
			changed := g.changed
			g.mu.Unlock()
			if ok {
				return c, nil
			}
			wait := time.Until(deadline)
			if wait <= 0 {
				_ = c.Close()
				break
			}
			select {
			case <-changed:
			case <-time.After(wait):
			}
		}
	}
}

// admit makes room for a connection of client, evicting if it must; the
// caller holds g.mu.
func (g *connGuard) admit(client string) bool {
	if g.perClient > 0 {
		n := 0
		for _, s := range g.conns {
			if s.client == client {
				n++
			}
		}
		if n >= g.perClient && !g.evict(func(s *guarded) bool { return s.client == client }) {
			return false
		}
	}
	if g.max > 0 && len(g.conns) >= g.max && !g.evict(func(*guarded) bool { return true }) {
		return false
	}
	return true
}

// evict closes the connection matching which that has been evictable the
// longest; false if none is.
func (g *connGuard) evict(which func(*guarded) bool) bool {
	var victim net.Conn
	var oldest time.Time
	for c, s := range g.conns {
		if !s.busy && which(s) && (victim == nil || s.since.Before(oldest)) {
			victim, oldest = c, s.since
		}
	}
	if victim == nil {
		return false
	}
	delete(g.conns, victim)
	_ = victim.Close()
	return true
}

// track is the server's ConnState hook.
func (g *connGuard) track(c net.Conn, state http.ConnState) {
	g.mu.Lock()
	defer g.mu.Unlock()
	s, ok := g.conns[c]
	switch state {
	case http.StateActive:
		if ok {
			s.busy = true
		}
		return
	case http.StateIdle:
		if ok {
			s.busy, s.since = false, time.Now()
		}
	case http.StateHijacked, http.StateClosed:
		delete(g.conns, c)
	default:
		return
	}
	close(g.changed)
	g.changed = make(chan struct{})
}

func clientOf(a net.Addr) string {
	if tcp, ok := a.(*net.TCPAddr); ok {
		return tcp.IP.String()
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return host
}

// minBodyRate cuts a request whose body arrives slower than rate bytes a
// second after a grace period (a body announced and never sent, or sent a
// byte at a time), where ReadTimeout alone would hold the connection, busy
// and not evictable, for its whole length. The handler's read fails (a
// timeout) and it answers as to any unreadable body.
//
// While a request waits for its body, its connection counts as waiting
// (evictable) for connGuard: a client that announces a body and sends
// nothing holds no slot that another client needs.
//
// The first deadline is set before the handler runs: a handler that
// answers without reading the body (413 on its announced length, say)
// leaves net/http to drain it before the answer, and that read is bound
// too. No deadline goes past readTimeout, the server's own bound.
func (g *connGuard) minBodyRate(next http.Handler, rate int, grace, readTimeout time.Duration) http.Handler {
	if rate <= 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			conn, _ := r.Context().Value(connKey{}).(net.Conn)
			now := time.Now()
			rr := &rateReader{body: r.Body, rc: http.NewResponseController(w), start: now, rate: rate, grace: grace, guard: g, conn: conn}
			if readTimeout > 0 {
				rr.limit = now.Add(readTimeout)
			}
			rr.setDeadline()
			r.Body = rr
		}
		next.ServeHTTP(w, r)
	})
}

// connKey keys a request's connection in its context (the server's
// ConnContext, withConn).
type connKey struct{}

func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// waiting marks c's request as waiting for its body (evictable) or busy.
func (g *connGuard) waiting(c net.Conn, waiting bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if s, ok := g.conns[c]; ok && s.busy == waiting {
		s.busy = !waiting
		if waiting {
			s.since = time.Now()
		}
	}
}

// rateBudgetChunk is the data a read may wait for beyond what the rate
// has earned so far.
const rateBudgetChunk = 1 << 10

type rateReader struct {
	body  io.ReadCloser
	rc    *http.ResponseController
	start time.Time
	rate  int
	grace time.Duration
	n     int64
	done  bool
	guard *connGuard
	conn  net.Conn
	limit time.Time // the server's ReadTimeout, which no deadline passes
}

// setDeadline allows the next rateBudgetChunk bytes what the rate has
// earned by then.
func (b *rateReader) setDeadline() {
	allowed := b.grace + time.Duration(float64(b.n+rateBudgetChunk)/float64(b.rate)*float64(time.Second))
	d := b.start.Add(allowed)
	if !b.limit.IsZero() && d.After(b.limit) {
		d = b.limit
	}
	_ = b.rc.SetReadDeadline(d)
}

func (b *rateReader) Read(p []byte) (int, error) {
	if !b.done {
		b.setDeadline()
	}
	if b.conn != nil {
		b.guard.waiting(b.conn, true)
	}
	n, err := b.body.Read(p)
	if b.conn != nil {
		b.guard.waiting(b.conn, false)
	}
	b.n += int64(n)
	if errors.Is(err, io.EOF) && !b.done {
		// The body is over: no deadline of ours may outlive it (net/http's
		// background read after the body would cancel the request's
		// context when it expires). After any other error (the deadline
		// passed) the expired deadline stays, so that net/http gives up
		// the rest of the body at once and closes the connection.
		b.done = true
		_ = b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

func (b *rateReader) Close() error { return b.body.Close() }
