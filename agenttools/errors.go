package agenttools

import (
	"errors"
	"sort"
	"strings"
)

// Errors of Runner.Call; test with errors.Is.
var (
	// ErrUnknownTool: no tool of that name.
	ErrUnknownTool = errors.New("no such tool")
	// ErrMissingKey: a keyed tool was called without an idempotency key.
	ErrMissingKey = errors.New("this tool needs an idempotency key from the host (MCP _meta \"" + MetaIdempotencyKey + "\", or the Idempotency-Key header over HTTP); it is not a tool argument")
	// ErrInvalidKey: the key is empty after trimming, longer than
	// MaxKeyLength, not valid UTF-8, or holds a control character.
	ErrInvalidKey = errors.New("the idempotency key must be 1 to 255 bytes of printable UTF-8 text")
	// ErrKeyConflict: the key was used before with other arguments.
	ErrKeyConflict = errors.New("this idempotency key was already used for a call with other arguments")
)

// InputError is input the tool refuses before writing anything: Fields
// maps an argument (JSON path) to what is wrong with it.
type InputError struct {
	Message string
	Fields  map[string]string
	// Malformed is set when the arguments did not decode into the input
	// type (bad JSON, a wrong type, an unknown or duplicate field), as
	// opposed to values the tool's validation refused.
	Malformed bool
}

func (e *InputError) Error() string {
	if len(e.Fields) == 0 {
		return e.Message
	}
	keys := make([]string, 0, len(e.Fields))
	for k := range e.Fields {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + ": " + e.Fields[k]
	}
	msg := "invalid arguments: " + strings.Join(parts, "; ")
	if e.Message != "" {
		msg = e.Message + ": " + msg
	}
	return msg
}

type fieldErrorer interface{ FieldErrors() map[string]string }

func asInputError(err error) error {
	var ie *InputError
	if errors.As(err, &ie) {
		return ie
	}
	var fe fieldErrorer
	if errors.As(err, &fe) {
		return &InputError{Fields: fe.FieldErrors()}
	}
	return &InputError{Message: err.Error()}
}
