package middleware_test

import (
	"context"
	"errors"
	"log/slog"
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
