package pipeline

import (
	"errors"
	"fmt"
	"time"
)

// permanentError marks an error that no retry can cure.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as one that retrying cannot fix: a payload that does
// not decode, a schema version nobody knows, a request the provider rejects
// as invalid. The in-process retry and the durable retry give up on it at
// once, and the poison store takes the message with the reason (ferry
// poison show). Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err: err}
}

// IsPermanent reports whether err, or any error it wraps, was marked Permanent.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// DeferredError asks for a message to be delivered again after Delay
// without counting as a failure: a budget is spent or a circuit is open.
type DeferredError struct {
	Err   error
	Delay time.Duration
}

func (e *DeferredError) Error() string {
	return fmt.Sprintf("deferred for %s: %v", e.Delay, e.Err)
}

func (e *DeferredError) Unwrap() error { return e.Err }

// Defer returns an error that makes the durable-retry middleware deliver
// the message again after delay, without counting an attempt, instead of
// failing it towards the poison queue.
func Defer(err error, delay time.Duration) error {
	return &DeferredError{Err: err, Delay: delay}
}

// Deferred reports whether err asks for deferral, and for how long.
func Deferred(err error) (time.Duration, bool) {
	var d *DeferredError
	if errors.As(err, &d) {
		return d.Delay, true
	}
	return 0, false
}

// ErrIDConflict is reported by a ledger when a message id it has processed
// comes again with other content: not a redelivery but a forged or broken
// publisher. Never drop such a delivery as a duplicate.
var ErrIDConflict = errors.New("message id already processed with different content")

// infrastructureError marks a failure of Ferry's own infrastructure.
type infrastructureError struct{ err error }

func (e infrastructureError) Error() string { return e.err.Error() }
func (e infrastructureError) Unwrap() error { return e.err }

// Infrastructure marks err as a failure of the pipeline's own
// infrastructure (the ledger's database unreachable, its connection reset,
// a serialization failure), not of the message or its handler. Such a
// failure must not spend the message's attempts, let alone poison it: the
// consumer chain waits it out and tries again (see
// middleware.WaitOutInfrastructure). Infrastructure(nil) is nil.
func Infrastructure(err error) error {
	if err == nil {
		return nil
	}
	if IsInfrastructure(err) {
		return err
	}
	return infrastructureError{err: err}
}

// IsInfrastructure reports whether err, or any error it wraps, was marked
// Infrastructure.
func IsInfrastructure(err error) bool {
	var i infrastructureError
	return errors.As(err, &i)
}

// LedgerEntry is one message of a batch recorded in a consumer's ledger
// (pgledger.Ledger.OnceBatch).
type LedgerEntry struct {
	MessageID string
	// Digest is ContentDigest of the message (nil: not checked).
	Digest []byte
}

// LedgerResult is what a batch ledger did with one LedgerEntry.
type LedgerResult struct {
	// Ran: the entry was new and the batch handler ran with it; its ledger
	// row committed with the handler's writes.
	Ran bool
	// Err, for an entry processed before with other content, wraps
	// ErrIDConflict. An entry with neither Ran nor Err was a duplicate
	// delivery.
	Err error
}
