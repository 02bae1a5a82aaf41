package pipeline

import (
	"encoding/json"

	"github.com/ThreeDotsLabs/watermill/message"
)

// MaxErrorHistory is how many failed attempts a message remembers
// (MetaErrorHistory): enough to tell a flapping dependency from a
// consistent refusal, small enough to travel in every header.
const MaxErrorHistory = 10

// FailedAttempt is one entry of a message's error history.
type FailedAttempt struct {
	Attempt int    `json:"attempt"`
	At      string `json:"at"`
	Error   string `json:"error"`
}

// ErrorHistory returns msg's failed attempts, oldest first; a history that
// does not decode (written by hand) is returned empty.
func ErrorHistory(md message.Metadata) []FailedAttempt {
	var h []FailedAttempt
	if v := md.Get(MetaErrorHistory); v != "" {
		_ = json.Unmarshal([]byte(v), &h)
	}
	return h
}

// AppendErrorHistory records a failed attempt on msg, keeping the newest
// MaxErrorHistory entries.
func AppendErrorHistory(msg *message.Message, a FailedAttempt) {
	h := append(ErrorHistory(msg.Metadata), a)
	if len(h) > MaxErrorHistory {
		h = h[len(h)-MaxErrorHistory:]
	}
	b, err := json.Marshal(h)
	if err != nil {
		return // strings and ints always encode
	}
	msg.Metadata.Set(MetaErrorHistory, string(b))
}
