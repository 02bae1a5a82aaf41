package middleware

// Outcome is what became of one delivery, for metrics.
type Outcome string

// Outcomes the chain records.
const (
	OutcomeHandled        Outcome = "handled"
	OutcomeDuplicate      Outcome = "duplicate"
	OutcomeRetryScheduled Outcome = "retry_scheduled"
	OutcomeDeferred       Outcome = "deferred"
	OutcomePoisoned       Outcome = "poisoned"
	// OutcomeIDConflict is a delivery whose id the ledger processed with
	// other content (forged or broken publisher); it is poisoned.
	OutcomeIDConflict Outcome = "id_conflict"
	// OutcomeInfrastructureRetry is an attempt that failed because Ferry's
	// own infrastructure did; it is retried without counting.
	OutcomeInfrastructureRetry Outcome = "infrastructure_retry"
	// OutcomeRetried is an in-process retry of a failed attempt.
	OutcomeRetried Outcome = "retried"
	// OutcomePoisonStoreFailed is a poisoned message the poison store
	// refused (its database down); it is held and stored again later.
	OutcomePoisonStoreFailed Outcome = "poison_store_failed"
)

// Recorder is told the outcome of every delivery, by route name
// (metrics.Metrics is Ferry's). Implementations must be safe for concurrent use.
type Recorder interface {
	Record(handler string, outcome Outcome)
}

// CauseRecorder, implemented by a Recorder (metrics.Metrics is), is told
// the cause of each poisoning (pipeline.ReasonGroup of its error), so that
// a new cause can page while an older one is paging already.
type CauseRecorder interface {
	RecordPoisonCause(handler, cause string)
}

// BatchRecorder is told of every batch of a batch route (Batcher), when
// the chain's Recorder implements it (metrics.Metrics does): its size, and
// whether it committed or failed as a whole (its messages then go one by
// one).
type BatchRecorder interface {
	RecordBatch(handler string, size int, committed bool)
}

type nopRecorder struct{}

func (nopRecorder) Record(string, Outcome) {}

func recorderOr(r Recorder) Recorder {
	if r == nil {
		return nopRecorder{}
	}
	return r
}
