package pipeline

import "errors"

// permanentError marks an error that no retry can cure.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as one that retrying cannot fix: a payload that does
// not decode, a schema version nobody knows, a request the provider rejects
// as invalid. The retry middleware gives up on it at once and the poison
// queue takes the message with the reason. Permanent(nil) is nil.
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
