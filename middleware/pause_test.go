package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
)

type pauses struct {
	mu     sync.Mutex
	paused map[string]bool
	reads  atomic.Int32
	fail   bool
}

func (p *pauses) Paused(context.Context) (map[string]bool, error) {
	p.reads.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail {
		return nil, errors.New("database unreachable")
	}
	out := map[string]bool{}
	for k, v := range p.paused {
		out[k] = v
	}
	return out, nil
}

func (p *pauses) set(route string, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused[route] = on
}

// A paused route's message waits before its handler runs, and runs once
// resumed; other routes go on; the paused routes are read once per Poll,
// not per message; an outage of the source keeps the last known state.
func TestPauseHoldsAPausedRoutesMessagesUntilResumed(t *testing.T) {
	t.Parallel()
	src := &pauses{paused: map[string]bool{"payments.charge": true}}
	mw, err := middleware.PauseConfig{Source: src, Poll: 50 * time.Millisecond}.Middleware(slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	var ran atomic.Int32
	h := func(*message.Message) ([]*message.Message, error) { ran.Add(1); return nil, nil }
	mws := []message.HandlerMiddleware{mw}

	require.Equal(t, []error{nil}, deliver(t, "notifications.mail@w1", mws, h, message.NewMessage("m1", nil)))
	require.EqualValues(t, 1, ran.Load(), "another route goes on")

	done := make(chan []error, 1)
	go func() { done <- deliver(t, "payments.charge@3", mws, h, message.NewMessage("m2", nil)) }()
	time.Sleep(300 * time.Millisecond)
	require.EqualValues(t, 1, ran.Load(), "a partition of the paused route waits")
	require.Less(t, src.reads.Load(), int32(12), "read once per poll, not in a busy loop")
	src.mu.Lock()
	src.fail = true
	src.mu.Unlock()
	time.Sleep(200 * time.Millisecond)
	require.EqualValues(t, 1, ran.Load(), "an outage of the source neither pauses nor resumes")
	src.mu.Lock()
	src.fail = false
	src.mu.Unlock()
	src.set("payments.charge", false)
	select {
	case errs := <-done:
		require.Equal(t, []error{nil}, errs)
	case <-time.After(10 * time.Second):
		t.Fatal("the resumed route's message never ran")
	}
	require.EqualValues(t, 2, ran.Load())

	_, err = middleware.PauseConfig{}.Middleware(slog.New(slog.DiscardHandler))
	require.Error(t, err, "a pause link needs its source")
}

// scriptedSource answers each read with the next of its errors (nil: the
// routes), as a database link would: silent, dropped, or answering.
type scriptedSource struct {
	mu    sync.Mutex
	errs  []error
	reads int
}

func (s *scriptedSource) Paused(ctx context.Context) (map[string]bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reads++
	if len(s.errs) == 0 {
		return map[string]bool{"h": true}, nil
	}
	err := s.errs[0]
	s.errs = s.errs[1:]
	if errors.Is(err, context.DeadlineExceeded) {
		s.mu.Unlock()
		<-ctx.Done() // silent: only the read's bound ends it
		s.mu.Lock()
		return nil, fmt.Errorf("%w: %w", err, ctx.Err())
	}
	return nil, err
}

// The watch tells a database out of reach (no answer in time, a connection
// dropped twice over) from one that answers with an error (a backend an
// administrator terminated: the next connection will do): only the first
// makes the consumers step aside, and the next good read brings them back.
func TestThePauseWatchTellsADatabaseOutOfReach(t *testing.T) {
	src := &scriptedSource{}
	w, err := middleware.NewPauseWatch(src, time.Millisecond, nil)
	require.NoError(t, err)
	read := func(errs ...error) error {
		src.mu.Lock()
		src.errs = errs
		src.mu.Unlock()
		time.Sleep(2 * time.Millisecond) // past the poll
		return w.Unreachable(context.Background())
	}
	require.NoError(t, read())
	require.True(t, w.Paused(context.Background(), "h"))

	silent := fmt.Errorf("no answer: %w", context.DeadlineExceeded)
	require.Error(t, read(silent), "no answer in time")
	require.True(t, w.Paused(context.Background(), "h"), "what was known is kept")
	require.NoError(t, read(), "back once a read succeeds")

	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	require.Error(t, read(refused, refused))
	require.NoError(t, read())

	// A pooled connection whose backend died fails once; the retry, on
	// another connection within the same bound, answers.
	require.NoError(t, read(io.ErrUnexpectedEOF))
	// The server answered, with an error: reachable.
	require.NoError(t, read(errors.New("FATAL: terminating connection due to administrator command (SQLSTATE 57P01)"), errors.New("FATAL: again")))
}
