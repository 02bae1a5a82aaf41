package middleware_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
)

type countingRecorder struct {
	mu sync.Mutex
	n  map[middleware.Outcome]int
}

func (r *countingRecorder) Record(_ string, o middleware.Outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n = map[middleware.Outcome]int{}
	}
	r.n[o]++
}

func (r *countingRecorder) count(o middleware.Outcome) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[o]
}

// An infrastructure failure is tried again for as long as it lasts, without
// an attempt spent, logged and counted each time; the handler's own errors
// pass through at once.
func TestInfrastructureFailuresAreWaitedOut(t *testing.T) {
	t.Parallel()
	rec := &countingRecorder{}
	var logs bytes.Buffer
	logger := slog.New(pipeline.LogHandler(slog.NewTextHandler(&logs, nil)))
	mw, err := middleware.InfrastructureConfig{Initial: time.Millisecond, Max: 2 * time.Millisecond, Recorder: rec}.Middleware(logger)
	require.NoError(t, err)

	calls := 0
	produced, err := mw(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		if calls <= 5 {
			return nil, pipeline.Infrastructure(errors.New("beginning ledger transaction: connection refused"))
		}
		return nil, nil
	})(message.NewMessage("m", nil))
	require.NoError(t, err)
	require.Nil(t, produced)
	require.Equal(t, 6, calls)
	require.Equal(t, 5, rec.count(middleware.OutcomeInfrastructureRetry))
	require.Equal(t, 5, strings.Count(logs.String(), "infrastructure unavailable"))
	require.Contains(t, logs.String(), "level=WARN")

	calls = 0
	_, err = mw(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, errors.New("provider said no")
	})(message.NewMessage("m2", nil))
	require.EqualError(t, err, "provider said no")
	require.Equal(t, 1, calls)

	// A stopping consumer ends the wait; the error is not poisonable.
	ctx, cancel := context.WithCancel(context.Background())
	msg := message.NewMessage("m3", nil)
	msg.SetContext(ctx)
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	_, err = mw(func(*message.Message) ([]*message.Message, error) {
		return nil, pipeline.Infrastructure(errors.New("down"))
	})(msg)
	require.ErrorIs(t, err, context.Canceled)
}

// Quick retries log one WARN line per retry on the message's context (so
// with its ids), never Watermill's id-less ERROR line.
func TestRetryLogsOneConsistentLine(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	logger := slog.New(pipeline.LogHandler(slog.NewTextHandler(&logs, nil)))
	retry, err := middleware.RetryConfig{MaxRetries: 2, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond}.Middleware(logger)
	require.NoError(t, err)
	h := middleware.Correlation(retry(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("flaky")
	}))
	msg := message.NewMessage("msg-42", nil)
	msg.Metadata.Set(pipeline.MetaCorrelationID, "corr-7")
	_, err = h(msg)
	require.Error(t, err)
	out := logs.String()
	require.Equal(t, 2, strings.Count(out, "handler failed; retrying in process"), out)
	require.NotContains(t, out, "Error occurred, retrying")
	require.NotContains(t, out, "level=ERROR")
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		require.Contains(t, line, "message_id=msg-42")
		require.Contains(t, line, "correlation_id=corr-7")
	}

	// Infrastructure failures are not quick-retried: the link outside waits them out.
	calls := 0
	_, err = retry(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, pipeline.Infrastructure(errors.New("down"))
	})(message.NewMessage("x", nil))
	require.Error(t, err)
	require.Equal(t, 1, calls)
}
