package middleware_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
)

// outcomes is a Recorder that keeps what it was told.
type outcomes struct {
	mu  sync.Mutex
	got []middleware.Outcome
}

func (o *outcomes) Record(_ string, out middleware.Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.got = append(o.got, out)
}

// The outcome names are the metrics' label values: dashboards and alerts
// match them, so they never change silently.
func TestOutcomeNamesAreTheMetricsLabels(t *testing.T) {
	require.Equal(t, map[middleware.Outcome]string{
		middleware.OutcomeHandled:             "handled",
		middleware.OutcomeDuplicate:           "duplicate",
		middleware.OutcomeRetryScheduled:      "retry_scheduled",
		middleware.OutcomeDeferred:            "deferred",
		middleware.OutcomePoisoned:            "poisoned",
		middleware.OutcomeIDConflict:          "id_conflict",
		middleware.OutcomeInfrastructureRetry: "infrastructure_retry",
		middleware.OutcomeRetried:             "retried",
		middleware.OutcomePoisonStoreFailed:   "poison_store_failed",
	}, map[middleware.Outcome]string{
		middleware.OutcomeHandled:             string(middleware.OutcomeHandled),
		middleware.OutcomeDuplicate:           string(middleware.OutcomeDuplicate),
		middleware.OutcomeRetryScheduled:      string(middleware.OutcomeRetryScheduled),
		middleware.OutcomeDeferred:            string(middleware.OutcomeDeferred),
		middleware.OutcomePoisoned:            string(middleware.OutcomePoisoned),
		middleware.OutcomeIDConflict:          string(middleware.OutcomeIDConflict),
		middleware.OutcomeInfrastructureRetry: string(middleware.OutcomeInfrastructureRetry),
		middleware.OutcomeRetried:             string(middleware.OutcomeRetried),
		middleware.OutcomePoisonStoreFailed:   string(middleware.OutcomePoisonStoreFailed),
	})
}

// A link with a Recorder tells it each outcome it decides, by route name;
// without one (nil) it records nothing and works the same.
func TestLinksTellTheirRecorder(t *testing.T) {
	run := func(rec middleware.Recorder) int {
		mw, err := middleware.InfrastructureConfig{Initial: time.Millisecond, Max: time.Millisecond, Recorder: rec}.Middleware(nil)
		require.NoError(t, err)
		calls := 0
		h := mw(func(*message.Message) ([]*message.Message, error) {
			calls++
			if calls < 3 {
				return nil, pipeline.Infrastructure(errors.New("database down"))
			}
			return nil, nil
		})
		msg := message.NewMessage("r-1", nil)
		msg.SetContext(context.Background())
		_, err = h(msg)
		require.NoError(t, err)
		return calls
	}
	rec := &outcomes{}
	require.Equal(t, 3, run(rec))
	require.Equal(t, []middleware.Outcome{middleware.OutcomeInfrastructureRetry, middleware.OutcomeInfrastructureRetry}, rec.got)
	require.Equal(t, 3, run(nil), "no Recorder: the link works the same")
}
