package rabbit

import (
	"bufio"
	"net"
	"sync"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
)

// heldConn is the broker connection's socket with writes that can be held:
// while a batch is published its frames collect in a buffer and go out in
// one write when the batch is sent, instead of one write per message.
// amqp091 flushes after every publish (Channel.sendOpen), and a write is
// the dearest part of a publish on a small box; amqp091 has no way to
// publish several messages in one write, so this wraps the socket it
// dials (amqp.Config.Dial). Outside a hold every write goes out at once,
// so heartbeats and RPCs are never delayed by more than a batch's
// publishing.
type heldConn struct {
	net.Conn
	mu    sync.Mutex
	buf   *bufio.Writer
	holds int
	err   error // sticky: the socket failed
}

var heldConns sync.Map // local address -> *heldConn

func newHeldConn(c net.Conn) *heldConn {
	h := &heldConn{Conn: c, buf: bufio.NewWriterSize(c, 64<<10)}
	heldConns.Store(c.LocalAddr().String(), h)
	return h
}

func (h *heldConn) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err != nil {
		return 0, h.err
	}
	n, err := h.buf.Write(p)
	if err == nil && h.holds == 0 {
		err = h.buf.Flush()
	}
	if err != nil {
		h.fail(err)
	}
	return n, err
}

// fail keeps err and closes the socket, so amqp091's reader sees the
// connection end and the connection is redialled.
func (h *heldConn) fail(err error) {
	h.err = err
	_ = h.Conn.Close()
}

func (h *heldConn) hold() {
	h.mu.Lock()
	h.holds++
	h.mu.Unlock()
}

// release ends one hold and sends what is buffered (also another hold's:
// the byte stream stays in order, and nothing waits longer than needed).
func (h *heldConn) release() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.holds > 0 {
		h.holds--
	}
	if h.err != nil {
		return h.err
	}
	if err := h.buf.Flush(); err != nil {
		h.fail(err)
		return err
	}
	return nil
}

func (h *heldConn) Close() error {
	// Only this socket's entry: a new socket may already have its port.
	heldConns.CompareAndDelete(h.Conn.LocalAddr().String(), h)
	h.mu.Lock()
	if h.err == nil {
		_ = h.buf.Flush()
	}
	h.mu.Unlock()
	return h.Conn.Close()
}

// HoldWrites holds the writes of conn's current socket until the returned
// release is called, which sends them in one write and reports how that
// went: for a loop that publishes many messages at once, as
// BatchPublisher does with each batch. Nothing that waits for the broker's
// answer (a declare, a channel's open or close) may be sent while held. On
// a connection rabbit.Dial did not open it holds nothing.
func HoldWrites(conn *wamqp.ConnectionWrapper) (release func() error) {
	noop := func() error { return nil }
	if conn == nil || conn.Connection() == nil {
		return noop
	}
	local := conn.Connection().LocalAddr()
	if local == nil {
		return noop
	}
	v, ok := heldConns.Load(local.String())
	if !ok {
		return noop
	}
	h := v.(*heldConn)
	h.hold()
	return h.release
}
