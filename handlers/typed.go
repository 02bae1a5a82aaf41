package handlers

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/strictjson"
)

// Validator is implemented by event types that can check their own fields;
// Typed calls it after decoding.
type Validator interface {
	Validate() error
}

// TypedOption adjusts Typed.
type TypedOption func(*typedConfig)

type typedConfig struct {
	versions []string
}

// AcceptSchemaVersions sets the payload schema versions a handler accepts
// (default: pipeline.DefaultSchemaVersion only).
func AcceptSchemaVersions(versions ...string) TypedOption {
	return func(c *typedConfig) { c.versions = versions }
}

// Typed adapts fn, a handler of decoded events, to a Watermill handler.
//
// A message that cannot be fn's input (an unknown or missing
// schema_version, a payload that is not JSON of T, a T whose Validate
// fails) is refused with a pipeline.Permanent error: not retried, and
// poisoned with the reason. fn's own errors are returned as they are.
// The message is in fn's context (MessageFromContext).
func Typed[T any](fn func(ctx context.Context, event *T) error, opts ...TypedOption) message.NoPublishHandlerFunc {
	cfg := typedConfig{versions: []string{pipeline.DefaultSchemaVersion}}
	for _, o := range opts {
		o(&cfg)
	}
	return func(msg *message.Message) error {
		event, err := Decode[T](msg, cfg.versions...)
		if err != nil {
			return err
		}
		return fn(ContextWithMessage(msg.Context(), msg), event)
	}
}

// MaxPayloadBytes is the largest payload Decode accepts: what the outbox
// accepts (pipeline.MaxPayloadBytes, the one limit). A larger one did not
// come through Ferry and is refused.
const MaxPayloadBytes = pipeline.MaxPayloadBytes

// Decode decodes msg's payload as a T, checking its schema version against
// versions (default: pipeline.DefaultSchemaVersion). Its errors are Permanent.
func Decode[T any](msg *message.Message, versions ...string) (*T, error) {
	if len(versions) == 0 {
		versions = []string{pipeline.DefaultSchemaVersion}
	}
	if len(msg.Payload) > MaxPayloadBytes {
		return nil, pipeline.Permanent(fmt.Errorf("message %s payload is %d bytes, more than %d", msg.UUID, len(msg.Payload), MaxPayloadBytes))
	}
	v := msg.Metadata.Get(pipeline.MetaSchemaVersion)
	if v == "" {
		return nil, pipeline.Permanent(fmt.Errorf("message %s has no %s metadata", msg.UUID, pipeline.MetaSchemaVersion))
	}
	if !slices.Contains(versions, v) {
		return nil, pipeline.Permanent(fmt.Errorf("message %s has unknown %s %q (accepted: %v)", msg.UUID, pipeline.MetaSchemaVersion, v, versions))
	}
	event := new(T)
	// Strict: an event can come from anywhere, and a payload with a
	// duplicate key, a case-folded field name, invalid UTF-8 or a NUL
	// (which no retry or requeue could store) must be refused, not guessed
	// at. Unknown fields are accepted: events gain fields over time.
	if err := strictjson.Decode(msg.Payload, event, strictjson.Options{AllowUnknownFields: true}); err != nil {
		return nil, pipeline.Permanent(fmt.Errorf("decoding message %s payload: %w", msg.UUID, err))
	}
	if val, ok := any(event).(Validator); ok {
		if err := val.Validate(); err != nil {
			return nil, pipeline.Permanent(fmt.Errorf("message %s payload is invalid: %w", msg.UUID, err))
		}
	}
	return event, nil
}

type messageKey struct{}

// ContextWithMessage returns ctx carrying msg.
func ContextWithMessage(ctx context.Context, msg *message.Message) context.Context {
	return context.WithValue(ctx, messageKey{}, msg)
}

// MessageFromContext returns the message a Typed handler is processing, or nil.
func MessageFromContext(ctx context.Context) *message.Message {
	msg, _ := ctx.Value(messageKey{}).(*message.Message)
	return msg
}

// ErrNoMessage is returned by IdempotencyKey outside a Typed handler.
var ErrNoMessage = errors.New("no message in context")

// IdempotencyKey returns the key to send with an external call made for the
// message being handled: stable across redeliveries (it is built from the
// message's id, the publisher's UUID) and distinct per handler, so two handlers of one event never
// collide at a shared provider.
func IdempotencyKey(ctx context.Context) (string, error) {
	msg := MessageFromContext(ctx)
	if msg == nil || pipeline.MessageID(msg) == "" {
		return "", ErrNoMessage
	}
	return "ferry-" + pipeline.RouteName(message.HandlerNameFromCtx(ctx)) + "-" + pipeline.MessageID(msg), nil
}
