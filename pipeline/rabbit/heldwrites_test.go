package rabbit

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// socketPair is a connected TCP pair on loopback: the client side counted
// and wrapped in a heldConn, and the server side to read from.
func socketPair(t *testing.T) (*heldConn, *countingConn, net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	server := <-accepted
	require.NotNil(t, server)
	counted := &countingConn{Conn: c}
	h := newHeldConn(counted)
	t.Cleanup(func() { _ = h.Close(); _ = server.Close() })
	return h, counted, server
}

// readFor reads what arrives within d.
func readFor(t *testing.T, c net.Conn, d time.Duration) []byte {
	t.Helper()
	var got bytes.Buffer
	buf := make([]byte, 64<<10)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(d)))
	for {
		n, err := c.Read(buf)
		got.Write(buf[:n])
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return got.Bytes()
			}
			require.ErrorIs(t, err, io.EOF)
			return got.Bytes()
		}
	}
}

// While held, a batch's writes wait in the buffer and go out in one write,
// in order; outside a hold each goes out at once.
func TestHeldWritesGoOutInOneWrite(t *testing.T) {
	t.Parallel()
	h, counted, server := socketPair(t)
	require.Same(t, h, mustLoad(t, h), "Ferry's dial registers the socket")

	_, err := h.Write([]byte("a"))
	require.NoError(t, err)
	require.EqualValues(t, 1, counted.writes.Load(), "not held: written at once")
	require.Equal(t, []byte("a"), readFor(t, server, 100*time.Millisecond))

	h.hold()
	var want bytes.Buffer
	for i := range 100 {
		frame := bytes.Repeat([]byte{byte('0' + i%10)}, 300)
		want.Write(frame)
		n, err := h.Write(frame)
		require.NoError(t, err)
		require.Equal(t, len(frame), n)
	}
	require.EqualValues(t, 1, counted.writes.Load(), "held: nothing written yet")
	require.Empty(t, readFor(t, server, 50*time.Millisecond), "held: nothing on the wire")
	require.NoError(t, h.release())
	require.EqualValues(t, 2, counted.writes.Load(), "released: the 100 writes in one")
	require.Equal(t, want.Bytes(), readFor(t, server, 200*time.Millisecond), "every byte, in order")

	_, err = h.Write([]byte("b"))
	require.NoError(t, err)
	require.EqualValues(t, 3, counted.writes.Load(), "after the hold, written at once again")
}

// A hold's release sends the other holds' writes too: two batches of one
// connection never wait for each other's end.
func TestReleaseSendsWhatOtherHoldsBuffered(t *testing.T) {
	t.Parallel()
	h, counted, server := socketPair(t)
	h.hold()
	h.hold()
	_, err := h.Write([]byte("first"))
	require.NoError(t, err)
	_, err = h.Write([]byte("second"))
	require.NoError(t, err)
	require.NoError(t, h.release())
	require.Equal(t, []byte("firstsecond"), readFor(t, server, 200*time.Millisecond))
	_, err = h.Write([]byte("x"))
	require.NoError(t, err)
	require.EqualValues(t, 1, counted.writes.Load(), "still held by the other: buffered")
	require.NoError(t, h.release())
	require.EqualValues(t, 2, counted.writes.Load())
}

// A socket that fails under a hold fails the release, every later write,
// and is closed, so amqp091's reader ends and the connection is redialled.
func TestHeldWriteFailureIsReported(t *testing.T) {
	t.Parallel()
	h, counted, _ := socketPair(t)
	require.NoError(t, counted.Conn.Close())
	h.hold()
	_, err := h.Write([]byte("lost"))
	require.NoError(t, err, "buffered: the error comes with the release")
	err = h.release()
	require.Error(t, err)
	_, werr := h.Write([]byte("later"))
	require.ErrorIs(t, werr, err, "sticky")
	h.hold()
	require.Error(t, h.release(), "a later hold's release fails too")
}

// A connection Ferry did not dial holds nothing.
func TestHoldWritesOnAForeignConnectionIsANoop(t *testing.T) {
	t.Parallel()
	require.NoError(t, HoldWrites(nil)())
}

func mustLoad(t *testing.T, h *heldConn) *heldConn {
	t.Helper()
	v, ok := heldConns.Load(h.LocalAddr().String())
	require.True(t, ok)
	return v.(*heldConn)
}
