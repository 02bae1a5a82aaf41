package middleware_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
)

// refusingStore stands for a poison store whose database is down: it
// refuses the first n messages, then takes them.
type refusingStore struct {
	refuse int64
	calls  atomic.Int64
	stored atomic.Int64
}

func (s *refusingStore) Publish(string, ...*message.Message) error {
	if s.calls.Add(1) <= s.refuse {
		return errors.New("poison store: connection refused")
	}
	s.stored.Add(1)
	return nil
}

func (s *refusingStore) Close() error { return nil }

// A poison store that refuses a message does not make the delivery fail
// at once (a nack straight away redelivers it at once, forever: the
// handler's effect runs again each time and its partition is held). The
// store is tried again with a pause, the handler is not run again, every
// refusal is counted and the log says so once per interval.
func TestPoisonStoreRefusalIsWaitedOutNotHotLooped(t *testing.T) {
	t.Parallel()
	store := &refusingStore{refuse: 4}
	rec := &countingRecorder{}
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	mw, err := middleware.PoisonConfig{Publisher: store, Recorder: rec, StoreRetryInitial: 5 * time.Millisecond, StoreRetryMax: 20 * time.Millisecond}.Middleware(logger)
	require.NoError(t, err)

	var runs atomic.Int64
	start := time.Now()
	_, err = mw(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, pipeline.Permanent(errors.New("provider answered 400: Kunde ung\xfcltig"))
	})(message.NewMessage("m-1", []byte(`{}`)))
	require.NoError(t, err, "stored in the end, so acked")
	require.Equal(t, int64(1), runs.Load(), "the handler (and its effect) ran once")
	require.Equal(t, int64(5), store.calls.Load())
	require.Equal(t, int64(1), store.stored.Load())
	require.GreaterOrEqual(t, time.Since(start), 4*5*time.Millisecond*8/10, "paused between tries")
	require.Equal(t, 4, rec.count(middleware.OutcomePoisonStoreFailed))
	require.Equal(t, 1, strings.Count(logs.String(), "poison store refuses"), logs.String())

	// Stopping the consumer ends the wait: the delivery fails (nacked),
	// and nothing was acked as done.
	down := &refusingStore{refuse: 1 << 40}
	mw, err = middleware.PoisonConfig{Publisher: down, StoreRetryInitial: 5 * time.Millisecond, StoreRetryMax: 10 * time.Millisecond}.Middleware(nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	msg := message.NewMessage("m-2", []byte(`{}`))
	msg.SetContext(ctx)
	_, err = mw(func(*message.Message) ([]*message.Message, error) {
		return nil, pipeline.Permanent(errors.New("bad"))
	})(msg)
	require.Error(t, err)
	calls := down.calls.Load()
	require.Greater(t, calls, int64(1))
	require.Less(t, calls, int64(40), "a bounded rate of tries, not a hot loop")
}
