package agenttools

import (
	"context"
	"errors"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/pgtoolcalls"
)

// IntentStatusName is the read-only status tool every Runner has.
const IntentStatusName = "intent_status"

// MaxStatusIntents bounds one intent_status answer.
const MaxStatusIntents = 200

// StatusInput asks for the intents of an aggregate, or of one tool call.
type StatusInput struct {
	AggregateID    string `json:"aggregate_id,omitempty" jsonschema:"the aggregate (for example an order id) whose intents to show"`
	Tool           string `json:"tool,omitempty" jsonschema:"with idempotency_key: the tool whose call to show"`
	IdempotencyKey string `json:"idempotency_key,omitempty" jsonschema:"with tool: the key of the call whose intents to show"`
}

// Validate requires exactly one of aggregate_id or tool+idempotency_key.
func (in StatusInput) Validate() error {
	fields := map[string]string{}
	switch {
	case in.AggregateID != "" && (in.Tool != "" || in.IdempotencyKey != ""):
		fields["aggregate_id"] = "give either aggregate_id, or tool and idempotency_key, not both"
	case in.AggregateID == "" && in.Tool == "" && in.IdempotencyKey == "":
		fields["aggregate_id"] = "give aggregate_id, or tool and idempotency_key"
	case in.AggregateID == "" && in.Tool == "":
		fields["tool"] = "is required with idempotency_key"
	case in.AggregateID == "" && in.IdempotencyKey == "":
		fields["idempotency_key"] = "is required with tool"
	}
	if len(fields) > 0 {
		return &InputError{Fields: fields}
	}
	return nil
}

// Intent states, from the least to the most advanced.
const (
	StatePending    = "pending"    // in the outbox, due, not yet relayed
	StateScheduled  = "scheduled"  // in the outbox, delayed until available_at
	StateRetrying   = "retrying"   // the relay or a handler failed; it will be tried again (last_error says why)
	StateDispatched = "dispatched" // the broker has it; no handler has finished it yet
	StateHandled    = "handled"    // at least one handler processed it (handled_by says which)
	StatePoisoned   = "poisoned"   // a handler gave up on it (poisoned says why)
)

// IntentState is one intent and what became of it.
type IntentState = pgstatus.Intent

// Handling is one handler that processed an intent.
type Handling = pgstatus.Handled

// Retrying is a handler's durable retry waiting in the outbox.
type Retrying = pgstatus.RetryWait

// Poisoning is a handler that gave up on an intent.
type Poisoning = pgstatus.Poisoning

// StatusOutput is intent_status's answer.
type StatusOutput struct {
	Intents []IntentState `json:"intents"`
	// Truncated says more intents exist than MaxStatusIntents.
	Truncated bool `json:"truncated"`
}

func intentStatusTool(outboxTable pgoutbox.Table) Tool {
	t, err := New(Def{
		Name: IntentStatusName, Title: "Intent status", ReadOnly: true,
		Description: "Shows every intent (queued side effect) of an aggregate, or of one earlier tool call, and what became of it: " +
			"pending, scheduled, retrying (with the last error), dispatched, handled (by which handler) or poisoned (with the reason); " +
			"a dispatched intent a handler has not taken yet says what it waits behind (waiting_behind: a paused handler, or a held partition and its error). " +
			"Call it to check progress instead of calling a tool again.",
	}, func(ctx context.Context, tx pgx.Tx, _ *Emitter, in StatusInput) (StatusOutput, error) {
		return IntentStatus(ctx, tx, outboxTable, in)
	})
	if err != nil {
		panic(err) // a definition of this package's own: a bug, caught by its tests
	}
	return t
}

// IntentStatus answers intent_status on q (a transaction or pool) for the
// outbox table ("" for the default).
func IntentStatus(ctx context.Context, q pgx.Tx, outboxTable pgoutbox.Table, in StatusInput) (StatusOutput, error) {
	out := StatusOutput{Intents: []IntentState{}}
	var ids []string
	if in.AggregateID == "" {
		call, err := pgtoolcalls.Get(ctx, q, in.Tool, in.IdempotencyKey)
		if errors.Is(err, pgtoolcalls.ErrNoCall) {
			return out, &InputError{Fields: map[string]string{"idempotency_key": "no call of this tool with this key is recorded"}}
		}
		if err != nil {
			return out, err
		}
		ids = call.IntentIDs
		if len(ids) == 0 {
			return out, nil
		}
	}
	var now time.Time
	var err error
	out.Intents, now, err = pgstatus.Intents(ctx, q, outboxTable, in.AggregateID, ids, MaxStatusIntents+1)
	if err != nil {
		return out, err
	}
	if len(out.Intents) > MaxStatusIntents {
		out.Intents, out.Truncated = out.Intents[:MaxStatusIntents], true
	}
	for i := range out.Intents {
		s := &out.Intents[i]
		s.LastError = summary(s.LastError)
		for j := range s.Retrying {
			s.Retrying[j].LastError = summary(s.Retrying[j].LastError)
		}
		for j := range s.Poisoned {
			s.Poisoned[j].Reason = summary(s.Poisoned[j].Reason)
		}
		for j := range s.WaitingBehind {
			s.WaitingBehind[j].Reason = summary(s.WaitingBehind[j].Reason)
			s.WaitingBehind[j].By = "" // an operator's identity is not the agent's business
		}
		switch {
		case len(s.Poisoned) > 0:
			s.State = StatePoisoned
		case len(s.Retrying) > 0, !s.Dispatched && s.LastError != "":
			s.State = StateRetrying
		case len(s.HandledBy) > 0:
			s.State = StateHandled
		case s.Dispatched:
			s.State = StateDispatched
		case s.AvailableAt.After(now):
			s.State = StateScheduled
		default:
			s.State = StatePending
		}
		sort.SliceStable(s.HandledBy, func(a, b int) bool { return s.HandledBy[a].At.Before(s.HandledBy[b].At) })
	}
	return out, nil
}

// MaxStatusErrorLength bounds an error or reason intent_status shows.
const MaxStatusErrorLength = 300

// summary is what intent_status shows of an error: intent_status answers
// an agent (a model) and needs no token, so an error text that quotes a
// provider's answer must not carry personal data to it. Handlers should
// keep such data out of their errors in the first place (the example's
// charge handler keeps the status and the provider's code only); this is
// the second line: Ferry's one redaction (pipeline.RedactPersonal: mail
// addresses, phone, card and account numbers), the text cleaned and cut to
// MaxStatusErrorLength bytes.
func summary(s string) string { return pipeline.RedactText(s, MaxStatusErrorLength) }
