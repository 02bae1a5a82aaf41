package agenttools

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/strictjson"
)

// Def describes a tool.
type Def struct {
	// Name is the tool's name: 1 to 64 of a-z 0-9 _ -, starting with a letter.
	Name string
	// Title is a short human-readable name. Default: Name.
	Title string
	// Description tells the model what the tool does and when to use it.
	// Required.
	Description string
	// ReadOnly marks a tool that writes nothing (intent_status): it runs in
	// a READ ONLY transaction, needs no idempotency key and keeps no call
	// record; its Emitter refuses to emit.
	ReadOnly bool
	// KeyWindow, if positive, lets a call without a host key run under a key
	// derived from the tool's name and canonical arguments within the
	// current window of this length (the window's start is part of the
	// key). The trade-off: two genuinely distinct calls with the same
	// arguments inside one window count as one (the second is a replay),
	// and a retry that straddles a window boundary runs again. Keep it for
	// tools where "the same arguments within minutes" does mean "the same
	// request". Default 0: a keyed tool refuses a call without a key.
	KeyWindow time.Duration
}

// Body is a tool's work: its business writes go through tx, and its side
// effects leave only as intents through emit. Its error rolls back
// everything the call wrote; an error that should reach the caller as a
// field error is a *InputError.
type Body[In, Out any] func(ctx context.Context, tx pgx.Tx, emit *Emitter, in In) (Out, error)

// Tool is a defined tool (see New).
type Tool interface {
	// Def is the tool's definition.
	Def() Def
	// InputSchema and OutputSchema are the JSON Schemas of the tool's input
	// and output, generated from the Go types.
	InputSchema() *jsonschema.Schema
	OutputSchema() *jsonschema.Schema

	decode(args json.RawMessage) (in any, canonical []byte, err error)
	run(ctx context.Context, tx pgx.Tx, emit *Emitter, in any) (any, error)
}

var toolName = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,63}$`)

// New defines a tool. In and Out are structs; their fields' `json` tags
// name the arguments and results, and `jsonschema:"..."` tags describe them
// to the model. If *In (or In) has a Validate() error method it is called
// after decoding, before any write; a *InputError (or any error with a
// FieldErrors() map[string]string method) names the bad fields.
func New[In, Out any](d Def, body Body[In, Out]) (Tool, error) {
	var errs []error
	if !toolName.MatchString(d.Name) {
		errs = append(errs, fmt.Errorf("tools: name %q must be 1 to 64 of a-z 0-9 _ -, starting with a letter", d.Name))
	}
	if d.Description == "" {
		errs = append(errs, fmt.Errorf("tools: tool %q needs a description", d.Name))
	}
	if d.KeyWindow < 0 {
		errs = append(errs, fmt.Errorf("tools: tool %q: KeyWindow must not be negative", d.Name))
	}
	if body == nil {
		errs = append(errs, fmt.Errorf("tools: tool %q has no body", d.Name))
	}
	in, err := jsonschema.For[In](nil)
	if err != nil {
		errs = append(errs, fmt.Errorf("tools: input schema of %q: %w", d.Name, err))
	}
	out, err := jsonschema.For[Out](nil)
	if err != nil {
		errs = append(errs, fmt.Errorf("tools: output schema of %q: %w", d.Name, err))
	}
	if in != nil && in.Type != "object" {
		errs = append(errs, fmt.Errorf("tools: the input of %q must be a struct", d.Name))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if d.Title == "" {
		d.Title = d.Name
	}
	return &tool[In, Out]{def: d, body: body, in: in, out: out}, nil
}

type tool[In, Out any] struct {
	def     Def
	body    Body[In, Out]
	in, out *jsonschema.Schema
}

func (t *tool[In, Out]) Def() Def                         { return t.def }
func (t *tool[In, Out]) InputSchema() *jsonschema.Schema  { return t.in }
func (t *tool[In, Out]) OutputSchema() *jsonschema.Schema { return t.out }

type validator interface{ Validate() error }

func (t *tool[In, Out]) decode(args json.RawMessage) (any, []byte, error) {
	in := new(In)
	if len(args) == 0 || string(args) == "null" {
		args = json.RawMessage("{}")
	}
	if err := strictjson.Decode(args, in, strictjson.Options{}); err != nil {
		var se *strictjson.Error
		if errors.As(err, &se) && se.Path != "" {
			return nil, nil, &InputError{Fields: map[string]string{se.Path: se.Msg}, Malformed: true}
		}
		return nil, nil, &InputError{Message: "the arguments are not a valid JSON object: " + err.Error(), Malformed: true}
	}
	var v any = in
	if val, ok := v.(validator); ok {
		if err := val.Validate(); err != nil {
			return nil, nil, asInputError(err)
		}
	} else if val, ok := any(*in).(validator); ok {
		if err := val.Validate(); err != nil {
			return nil, nil, asInputError(err)
		}
	}
	// Canonical: the decoded value encoded again (fields in declaration
	// order, map keys sorted), so spacing, key order and escapes of the
	// caller's JSON do not change the call's identity.
	canonical, err := json.Marshal(in)
	if err != nil {
		return nil, nil, fmt.Errorf("encoding the arguments: %w", err)
	}
	return *in, canonical, nil
}

func (t *tool[In, Out]) run(ctx context.Context, tx pgx.Tx, emit *Emitter, in any) (any, error) {
	return t.body(ctx, tx, emit, in.(In))
}
