package evolve

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/strictjson"
)

// Step turns an event of one version into the next (an upcast) or, for a
// consumer behind a producer in a rolling deploy, into the one before (a
// downcast). Build one with Up, Down, Raw or RawDown.
type Step struct {
	From, To string
	down     bool
	// A typed step: decode the payload as fromType, apply, encode as toType.
	fromType, toType reflect.Type
	decode           func([]byte) (any, error)
	apply            func(any) (any, error)
	// A raw step works on the JSON itself, for what no Go type of the old
	// version expresses any more.
	raw func(json.RawMessage) (json.RawMessage, error)
}

func (s Step) String() string {
	kind := "up"
	if s.down {
		kind = "down"
	}
	return fmt.Sprintf("%s step %s→%s", kind, s.From, s.To)
}

// Up is the typed step that turns version from (a From) into version to
// (a To). Its errors poison the event with the step named in the reason.
func Up[From, To any](from, to string, fn func(From) (To, error)) Step {
	return typed[From, To](from, to, false, fn)
}

// Down is the typed step a consumer behind its producer uses: version from
// (a newer From) into version to (an older To), so that events a new
// producer writes during a rolling deploy are handled by the old consumer.
func Down[From, To any](from, to string, fn func(From) (To, error)) Step {
	return typed[From, To](from, to, true, fn)
}

func typed[From, To any](from, to string, down bool, fn func(From) (To, error)) Step {
	s := Step{From: from, To: to, down: down, fromType: reflect.TypeFor[From](), toType: reflect.TypeFor[To]()}
	if fn == nil {
		return s // refused by New
	}
	s.decode = func(b []byte) (any, error) {
		var v From
		if err := strictjson.Decode(b, &v, strictjson.Options{AllowUnknownFields: true}); err != nil {
			return nil, err
		}
		return v, nil
	}
	s.apply = func(v any) (any, error) { return fn(v.(From)) }
	return s
}

// Raw is an upcast on the JSON payload itself (a field renamed in a
// version whose Go type is gone, a value moved into a nested object).
func Raw(from, to string, fn func(json.RawMessage) (json.RawMessage, error)) Step {
	return Step{From: from, To: to, raw: fn} // a nil fn is refused by New
}

// RawDown is Raw for a downcast.
func RawDown(from, to string, fn func(json.RawMessage) (json.RawMessage, error)) Step {
	return Step{From: from, To: to, down: true, raw: fn}
}

// Schema is what Ferry's read paths and tools need of an event type's
// versions whatever its Go type: app.Options.Events lists them.
type Schema interface {
	// Name is the event type's name: the topic its events are published on.
	Name() string
	// Current is the version the code's type is.
	Current() string
	// Versions are every version the chain reaches the current one from,
	// oldest first, the current one included.
	Versions() []string
	// Upcast returns payload, an event of version, as JSON of the current
	// version.
	Upcast(version string, payload []byte) ([]byte, error)
	// Verify reports whether payload, an event of version, decodes as the
	// current type (Decode's error, or nil).
	Verify(version string, payload []byte) error
	// Fields describes the JSON of each version whose Go type the chain
	// knows (the current one, and each typed step's), for `ferry schema check`.
	Fields() map[string]Fields
	// Steps are the chain's steps, as registered.
	Steps() []Step
}

// Chain is an event type's versions: its current Go type T and the steps
// that bring every older (and, with Down, newer) version to it. Built by
// New, it is safe for concurrent use.
type Chain[T any] struct {
	name, current string
	steps         []Step
	paths         map[string][]Step // version → steps to the current one
}

// New validates and returns the chain of the event type name (its topic)
// whose current version is current, of Go type T. Versions are positive
// integers ("1", "2"); an up step goes to a higher version, a down step to a
// lower one. New refuses a chain with a gap (a step that leads to a
// version no step continues from), a duplicate (two steps from one version
// in one direction), a step whose types do not meet its neighbours' (a
// typed step into version 2 as one type, out of it as another), and a
// chain whose last step does not produce T. Every error names the event
// type and the step.
func New[T any](name, current string, steps ...Step) (*Chain[T], error) {
	c := &Chain[T]{name: name, current: current, steps: slices.Clone(steps), paths: map[string][]Step{current: nil}}
	if err := c.build(reflect.TypeFor[T]()); err != nil {
		return nil, fmt.Errorf("event type %q: %w", name, err)
	}
	return c, nil
}

func version(v string) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || strconv.Itoa(n) != v {
		return 0, fmt.Errorf("version %q is not a positive integer", v)
	}
	return n, nil
}

func (c *Chain[T]) build(t reflect.Type) error {
	if err := pipeline.ValidateTopicName(c.name); err != nil {
		return err
	}
	cur, err := version(c.current)
	if err != nil {
		return fmt.Errorf("current %w", err)
	}
	var errs []error
	ups, downs := map[string]Step{}, map[string]Step{}
	for _, s := range c.steps {
		from, err1 := version(s.From)
		to, err2 := version(s.To)
		if err := errors.Join(err1, err2); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", s, err))
			continue
		}
		if s.raw == nil && s.apply == nil {
			errs = append(errs, fmt.Errorf("%s: not made by Up, Down, Raw or RawDown, or its function is nil", s))
			continue
		}
		dir := ups
		switch {
		case s.down && to >= from, !s.down && to <= from:
			errs = append(errs, fmt.Errorf("%s goes the wrong way", s))
			continue
		case s.down && from <= cur:
			errs = append(errs, fmt.Errorf("%s starts at or below the current version %s: a down step brings a newer producer's events to this consumer", s, c.current))
			continue
		case !s.down && from >= cur:
			errs = append(errs, fmt.Errorf("%s starts at or above the current version %s", s, c.current))
			continue
		case s.down:
			dir = downs
		}
		if prev, dup := dir[s.From]; dup {
			errs = append(errs, fmt.Errorf("%s duplicates %s: one step per version and direction", s, prev))
			continue
		}
		dir[s.From] = s
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	// Every version a step starts from must reach the current one, and
	// typed neighbours must agree on the type of the version between them.
	for _, dir := range []map[string]Step{ups, downs} {
		for _, from := range slices.Sorted(maps.Keys(dir)) {
			var path []Step
			at, typ, typedBy := from, reflect.Type(nil), ""
			for at != c.current {
				s, ok := dir[at]
				if !ok {
					errs = append(errs, fmt.Errorf("a gap: %s leads to version %s, and no step continues from it to the current version %s", path[len(path)-1], at, c.current))
					break
				}
				if s.fromType != nil && typ != nil && s.fromType != typ {
					errs = append(errs, fmt.Errorf("version %s is %s out of %s but %s into %s", at, typ, typedBy, s.fromType, s))
				}
				path = append(path, s)
				if s.toType != nil {
					typ, typedBy = s.toType, s.String()
				} else {
					typ = nil
				}
				at = s.To
			}
			if at == c.current && typ != nil && typ != t {
				errs = append(errs, fmt.Errorf("%s produces %s, but the current version %s is %s", typedBy, typ, c.current, t))
			}
			c.paths[from] = path
		}
	}
	return errors.Join(errs...)
}

// Name is the event type's name.
func (c *Chain[T]) Name() string { return c.name }

// Current is the version T is.
func (c *Chain[T]) Current() string { return c.current }

// Steps are the steps New was given.
func (c *Chain[T]) Steps() []Step { return slices.Clone(c.steps) }

// Versions are the versions the chain reads, oldest first.
func (c *Chain[T]) Versions() []string {
	vs := slices.Collect(maps.Keys(c.paths))
	slices.SortFunc(vs, func(a, b string) int { x, _ := strconv.Atoi(a); y, _ := strconv.Atoi(b); return x - y })
	return vs
}

// ErrUnknownVersion is wrapped by the error for a version the chain does
// not reach.
var ErrUnknownVersion = errors.New("no step reaches the current version from this version")

// Decode returns payload, an event of version, as the current type:
// brought there step by step (a typed step's output goes to the next typed
// step without a JSON round trip), decoded strictly (unknown fields
// allowed: events gain fields), and checked by T's Validate method if it
// has one. Errors name the event type, the version and the step.
func (c *Chain[T]) Decode(version string, payload []byte) (*T, error) {
	v, raw, err := c.walk(version, payload)
	if err != nil {
		return nil, err
	}
	var event *T
	if v != nil {
		t := v.(T)
		event = &t
	} else {
		event = new(T)
		if err := strictjson.Decode(raw, event, strictjson.Options{AllowUnknownFields: true}); err != nil {
			return nil, fmt.Errorf("event type %q version %s: decoding as version %s: %w", c.name, version, c.current, err)
		}
	}
	if val, ok := any(event).(interface{ Validate() error }); ok {
		if err := val.Validate(); err != nil {
			return nil, fmt.Errorf("event type %q version %s: invalid as version %s: %w", c.name, version, c.current, err)
		}
	}
	return event, nil
}

// Verify is Decode without the result.
func (c *Chain[T]) Verify(version string, payload []byte) error {
	_, err := c.Decode(version, payload)
	return err
}

// Upcast returns payload, an event of version, as JSON of the current
// version (the console's "as current version", intent_status).
func (c *Chain[T]) Upcast(version string, payload []byte) ([]byte, error) {
	v, raw, err := c.walk(version, payload)
	if err != nil {
		return nil, err
	}
	if v != nil {
		return json.Marshal(v)
	}
	return raw, nil
}

// walk applies version's path to payload: it returns the typed value the
// last step produced, or nil and the JSON.
func (c *Chain[T]) walk(version string, payload []byte) (any, []byte, error) {
	path, ok := c.paths[version]
	if !ok {
		return nil, nil, fmt.Errorf("event type %q version %q: %w %s (it reads %s)", c.name, version, ErrUnknownVersion, c.current, strings.Join(c.Versions(), ", "))
	}
	var value any
	raw := payload
	for _, s := range path {
		var err error
		if s.raw != nil {
			if value != nil {
				if raw, err = json.Marshal(value); err != nil {
					return nil, nil, fmt.Errorf("event type %q: encoding version %s for %s: %w", c.name, s.From, s, err)
				}
				value = nil
			}
			if raw, err = s.raw(raw); err != nil {
				return nil, nil, fmt.Errorf("event type %q: %s: %w", c.name, s, err)
			}
			continue
		}
		if value == nil {
			if value, err = s.decode(raw); err != nil {
				return nil, nil, fmt.Errorf("event type %q: decoding version %s for %s: %w", c.name, s.From, s, err)
			}
		}
		if value, err = s.apply(value); err != nil {
			return nil, nil, fmt.Errorf("event type %q: %s: %w", c.name, s, err)
		}
	}
	return value, raw, nil
}

// DecodeMessage is Decode for a message, by its schema_version metadata.
// Its errors are pipeline.Permanent: no retry turns an event into another.
func (c *Chain[T]) DecodeMessage(msg *message.Message) (*T, error) {
	if len(msg.Payload) > pipeline.MaxPayloadBytes {
		return nil, pipeline.Permanent(fmt.Errorf("message %s payload is %d bytes, more than %d", msg.UUID, len(msg.Payload), pipeline.MaxPayloadBytes))
	}
	v := msg.Metadata.Get(pipeline.MetaSchemaVersion)
	if v == "" {
		return nil, pipeline.Permanent(fmt.Errorf("message %s has no %s metadata", msg.UUID, pipeline.MetaSchemaVersion))
	}
	event, err := c.Decode(v, msg.Payload)
	if err != nil {
		return nil, pipeline.Permanent(fmt.Errorf("message %s: %w", msg.UUID, err))
	}
	return event, nil
}

// NewEvent is pipeline.NewEvent stamped with the current version: a
// producer publishes the version of the type it has, never by hand.
func (c *Chain[T]) NewEvent(ctx context.Context, aggregateID string, event T) (*message.Message, error) {
	msg, err := pipeline.NewEvent(ctx, aggregateID, event)
	if err != nil {
		return nil, err
	}
	msg.Metadata.Set(pipeline.MetaSchemaVersion, c.current)
	return msg, nil
}

// Fields describes the JSON of every version whose Go type the chain knows.
func (c *Chain[T]) Fields() map[string]Fields {
	out := map[string]Fields{c.current: Describe(reflect.TypeFor[T]())}
	for _, s := range c.steps {
		if s.fromType != nil {
			if _, ok := out[s.From]; !ok {
				out[s.From] = Describe(s.fromType)
			}
		}
	}
	return out
}
