package agenttools

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgtoolcalls"
)

// MetaIdempotencyKey is the MCP request _meta key a host puts its
// idempotency key under.
const MetaIdempotencyKey = "dev.ferry/idempotency-key"

// MaxKeyLength bounds an idempotency key.
const MaxKeyLength = 255

// CallsTable is the call record table (migration 00011).
const CallsTable = pgtoolcalls.Table

// Runner runs tools: it owns their transaction, their call records and
// their idempotency. It is safe for concurrent use.
type Runner struct {
	pool   *pgxpool.Pool
	outbox *pgoutbox.Outbox
	logger *slog.Logger
	tools  []Tool
	byName map[string]Tool
	now    func() time.Time
}

// NewRunner returns a Runner of ts on pool, writing intents through outbox.
// IntentStatus is added unless ts has a tool of that name.
func NewRunner(pool *pgxpool.Pool, outbox *pgoutbox.Outbox, ts []Tool, logger *slog.Logger) (*Runner, error) {
	if pool == nil || outbox == nil {
		return nil, errors.New("tools: NewRunner needs a pool and an outbox")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := &Runner{pool: pool, outbox: outbox, logger: logger.With("component", "tools"), byName: map[string]Tool{}, now: time.Now}
	for _, t := range ts {
		if t == nil {
			return nil, errors.New("tools: nil tool")
		}
		if _, dup := r.byName[t.Def().Name]; dup {
			return nil, fmt.Errorf("tools: two tools are named %q", t.Def().Name)
		}
		r.byName[t.Def().Name] = t
		r.tools = append(r.tools, t)
	}
	if _, ok := r.byName[IntentStatusName]; !ok {
		st := intentStatusTool(outbox.Table())
		r.byName[IntentStatusName] = st
		r.tools = append(r.tools, st)
	}
	return r, nil
}

// Tools are the runner's tools, in the order given (IntentStatus last).
func (r *Runner) Tools() []Tool { return r.tools }

// Result is a call's answer.
type Result struct {
	Tool string `json:"tool"`
	// Key is the idempotency key the call ran under (derived, when the
	// tool allows a key from its arguments and the host gave none).
	Key        string `json:"idempotency_key,omitempty"`
	KeyDerived bool   `json:"idempotency_key_derived,omitempty"`
	// Output is the tool's output as JSON: for a replay, the stored one,
	// byte for byte.
	Output json.RawMessage `json:"result"`
	// Replay is true when the key had been seen with the same arguments:
	// nothing was written, Output is the first call's.
	Replay bool `json:"replay"`
	// IntentIDs are the message ids of the intents the call wrote.
	IntentIDs []string `json:"intent_ids"`
}

// Call runs tool name with args (a JSON object) under key (from the host).
// Its errors: ErrUnknownTool, ErrMissingKey, ErrInvalidKey, *InputError
// (nothing was written), ErrKeyConflict, or the body's or the database's.
func (r *Runner) Call(ctx context.Context, name, key string, args json.RawMessage) (*Result, error) {
	t, ok := r.byName[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownTool, name)
	}
	def := t.Def()
	in, canonical, err := t.decode(args)
	if err != nil {
		return nil, err
	}
	if def.ReadOnly {
		return r.readOnly(ctx, t, in)
	}
	res := &Result{Tool: name, Key: key, IntentIDs: []string{}}
	switch {
	case key == "" && def.KeyWindow > 0:
		window := r.now().Truncate(def.KeyWindow)
		sum := sha256.Sum256([]byte(name + "\x00" + window.UTC().Format(time.RFC3339Nano) + "\x00" + string(canonical)))
		res.Key, res.KeyDerived = "derived-"+hex.EncodeToString(sum[:16]), true
	case key == "":
		return nil, ErrMissingKey
	default:
		if err := checkKey(key); err != nil {
			return nil, err
		}
	}
	digest := sha256.Sum256(canonical)
	// InTx: BEGIN rides on the call record's INSERT, and the intents and
	// the stored result on the COMMIT, so a call of one statement and one
	// intent takes three round trips instead of six.
	err = r.outbox.InTx(ctx, r.pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
		// The record first: a concurrent call with the same key waits here
		// until this one commits (and then replays it) or rolls back (and
		// then runs it itself).
		claimed, err := pgtoolcalls.Claim(ctx, q, name, res.Key, digest[:])
		if err != nil {
			return err
		}
		if !claimed {
			earlier, err := pgtoolcalls.Get(ctx, q, name, res.Key)
			if err != nil {
				return fmt.Errorf("reading the earlier call: %w", err)
			}
			if !bytes.Equal(earlier.Digest, digest[:]) {
				return fmt.Errorf("%w (tool %s)", ErrKeyConflict, name)
			}
			res.Output, res.Replay, res.IntentIDs = earlier.Result, true, earlier.IntentIDs
			return nil
		}
		tx, err := q.Tx(ctx)
		if err != nil {
			return err
		}
		emit := &Emitter{pending: p}
		out, err := t.run(context.WithValue(ctx, keyCtx{}, res.Key), tx, emit, in)
		if err != nil {
			return err
		}
		if res.Output, err = json.Marshal(out); err != nil {
			return fmt.Errorf("encoding the result: %w", err)
		}
		res.IntentIDs = append(res.IntentIDs, emit.ids...)
		pgtoolcalls.QueueResult(p, name, res.Key, res.Output, res.IntentIDs)
		return nil
	})
	if err != nil {
		var ie *InputError
		if !errors.As(err, &ie) && !errors.Is(err, ErrKeyConflict) {
			r.logger.WarnContext(ctx, "tool call failed; nothing was written", "tool", name, "idempotency_key", res.Key,
				"correlation_id", pipeline.CorrelationIDFromContext(ctx), "error", err)
		}
		return nil, err
	}
	r.logger.InfoContext(ctx, "tool called", "tool", name, "idempotency_key", res.Key, "replay", res.Replay,
		"intents", len(res.IntentIDs), "correlation_id", pipeline.CorrelationIDFromContext(ctx))
	return res, nil
}

func (r *Runner) readOnly(ctx context.Context, t Tool, in any) (*Result, error) {
	res := &Result{Tool: t.Def().Name, IntentIDs: []string{}}
	err := pgx.BeginTxFunc(ctx, r.pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		out, err := t.run(ctx, tx, &Emitter{readOnly: true}, in)
		if err != nil {
			return err
		}
		res.Output, err = json.Marshal(out)
		return err
	})
	if err != nil {
		return nil, err
	}
	return res, nil
}

type keyCtx struct{}

// KeyFromContext returns the idempotency key of the tool call a body runs
// in ("" outside one), for a business row that keeps it (a unique column).
func KeyFromContext(ctx context.Context) string {
	k, _ := ctx.Value(keyCtx{}).(string)
	return k
}

// checkKey says what is wrong with a key, if anything: the caller's
// input, answered as such (400), never as a failure of the call.
func checkKey(key string) error {
	switch {
	case strings.TrimSpace(key) == "":
		return fmt.Errorf("%w: it is empty", ErrInvalidKey)
	case len(key) > MaxKeyLength:
		return fmt.Errorf("%w: it is %d bytes long", ErrInvalidKey, len(key))
	case !utf8.ValidString(key):
		return fmt.Errorf("%w: it is not valid UTF-8", ErrInvalidKey)
	case strings.IndexFunc(key, unicode.IsControl) >= 0:
		return fmt.Errorf("%w: it holds a control character", ErrInvalidKey)
	}
	return nil
}

// Describe lists a runner's tools for a catalogue (GET /tools).
func (r *Runner) Describe() []Description {
	out := make([]Description, len(r.tools))
	for i, t := range r.tools {
		d := t.Def()
		out[i] = Description{Name: d.Name, Title: d.Title, Description: d.Description, ReadOnly: d.ReadOnly,
			KeyRequired: !d.ReadOnly && d.KeyWindow == 0, InputSchema: t.InputSchema(), OutputSchema: t.OutputSchema()}
	}
	return out
}

// Description is one tool as a catalogue shows it.
type Description struct {
	Name         string `json:"name"`
	Title        string `json:"title"`
	Description  string `json:"description"`
	ReadOnly     bool   `json:"read_only"`
	KeyRequired  bool   `json:"idempotency_key_required"`
	InputSchema  any    `json:"input_schema"`
	OutputSchema any    `json:"output_schema"`
}
