package middleware_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
)

// The quick in-process retries are for blips: a transient failure is tried
// MaxRetries more times, and a handler that recovers within them succeeds;
// a Permanent error, an infrastructure outage and a deferral are not
// retried here (the poison link, the infrastructure link and the durable
// retry take them).
func TestRetryTriesTransientFailuresOnlyAndAtMostMaxRetries(t *testing.T) {
	t.Parallel()
	mw, err := middleware.RetryConfig{MaxRetries: 2, InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond}.Middleware(nil)
	require.NoError(t, err)
	for _, tc := range []struct {
		name      string
		fail      error
		failTimes int64
		wantRuns  int64
		wantErr   bool
	}{
		{"transient, always", errors.New("503"), 100, 3, true},
		{"transient, recovers", errors.New("503"), 2, 3, false},
		{"permanent", pipeline.Permanent(errors.New("400 invalid card")), 100, 1, true},
		{"infrastructure", pipeline.Infrastructure(errors.New("connection refused")), 100, 1, true},
		{"deferred", pipeline.Defer(errors.New("rate limited"), time.Minute), 100, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs atomic.Int64
			errs := deliver(t, "r", []message.HandlerMiddleware{mw}, func(*message.Message) ([]*message.Message, error) {
				if runs.Add(1) <= tc.failTimes {
					return nil, tc.fail
				}
				return nil, nil
			}, message.NewMessage("m-1", []byte(`{}`)))
			require.Equal(t, tc.wantRuns, runs.Load())
			if tc.wantErr {
				require.Error(t, errs[0])
			} else {
				require.NoError(t, errs[0])
			}
		})
	}
}

func TestRetryConfigRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	for _, c := range []middleware.RetryConfig{
		{InitialInterval: -time.Second},
		{InitialInterval: time.Minute, MaxInterval: time.Second},
		{Multiplier: 0.5},
		{Jitter: 2},
	} {
		_, err := c.Middleware(nil)
		require.Error(t, err, "%+v", c)
	}
	none, err := middleware.RetryConfig{MaxRetries: -1}.Middleware(nil)
	require.NoError(t, err)
	var runs atomic.Int64
	deliver(t, "r", []message.HandlerMiddleware{none}, func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, errors.New("503")
	}, message.NewMessage("m-1", nil))
	require.Equal(t, int64(1), runs.Load(), "a negative MaxRetries means none")
}
