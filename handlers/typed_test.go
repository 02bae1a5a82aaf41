package handlers_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
)

type greeting struct {
	Name string `json:"name"`
}

func (g greeting) Validate() error {
	if g.Name == "" {
		return errors.New("name is missing")
	}
	return nil
}

func msg(payload, version string) *message.Message {
	m := message.NewMessage("42", []byte(payload))
	if version != "" {
		m.Metadata.Set(pipeline.MetaSchemaVersion, version)
	}
	return m
}

func TestTypedRefusesWhatItCannotDecode(t *testing.T) {
	t.Parallel()
	h := handlers.Typed(func(ctx context.Context, g *greeting) error { return nil })
	cases := map[string]struct {
		m    *message.Message
		want string
	}{
		"not JSON":        {msg("nope", "1"), "decoding"},
		"wrong type":      {msg(`{"name": 5}`, "1"), "decoding"},
		"trailing data":   {msg(`{"name":"a"} {}`, "1"), "after the JSON value"},
		"missing field":   {msg(`{}`, "1"), "name is missing"},
		"unknown version": {msg(`{"name":"a"}`, "2"), `unknown schema_version "2"`},
		"no version":      {msg(`{"name":"a"}`, ""), "no schema_version"},
		// Payloads no retry or requeue could store, or that would be guessed at.
		"NUL":             {msg(`{"name":"a\u0000"}`, "1"), "NUL character"},
		"duplicate key":   {msg(`{"name":"a","name":"b"}`, "1"), "name: is given twice"},
		"case-folded key": {msg(`{"NAME":"a"}`, "1"), "case-sensitive"},
		"invalid UTF-8":   {msg("{\"name\":\"a\xff\"}", "1"), "not valid UTF-8"},
	}
	for name, tc := range cases {
		err := h(tc.m)
		require.ErrorContains(t, err, tc.want, name)
		require.True(t, pipeline.IsPermanent(err), "%s: decode errors are permanent", name)
	}
}

func TestTypedPassesHandlerErrorsAndMessage(t *testing.T) {
	t.Parallel()
	boom := errors.New("provider down")
	h := handlers.Typed(func(ctx context.Context, g *greeting) error {
		if handlers.MessageFromContext(ctx).UUID != "42" {
			return errors.New("message not in context")
		}
		return boom
	}, handlers.AcceptSchemaVersions("1", "2"))
	err := h(msg(`{"name":"a"}`, "2"))
	require.ErrorIs(t, err, boom)
	require.False(t, pipeline.IsPermanent(err), "the handler's own errors are retried")
}

func TestValidateRoutes(t *testing.T) {
	t.Parallel()
	ok := func(*message.Message) error { return nil }
	require.NoError(t, handlers.ValidateRoutes([]handlers.Route{{Name: "a.b", Topic: "t.c", Handler: ok}}))
	err := handlers.ValidateRoutes([]handlers.Route{
		{Name: "a", Topic: "t", Handler: ok},
		{Name: "a", Topic: "t", Handler: ok},
		{Name: "bad name!", Topic: "", Handler: nil},
	})
	require.ErrorContains(t, err, "used twice")
	require.ErrorContains(t, err, "bad name!")
	require.ErrorContains(t, err, "no handler")
}

// A handler of decoded events: Typed checks the schema version, decodes the
// JSON payload and calls Validate before the handler runs.
func ExampleTyped() {
	route := handlers.Route{
		Name:  "greetings.welcome", // stable: it names the queue and the ledger key
		Topic: "user.signed_up",
		Handler: handlers.Typed(func(ctx context.Context, g *greeting) error {
			key, _ := handlers.IdempotencyKey(ctx) // send this with any external call
			fmt.Println("welcome,", g.Name, "key set:", key != "")
			return nil
		}),
	}

	m := message.NewMessage("1001", []byte(`{"name":"Ada"}`))
	m.Metadata.Set(pipeline.MetaSchemaVersion, "1")
	if err := route.Handler(m); err != nil {
		fmt.Println("error:", err)
	}
	bad := message.NewMessage("1002", []byte(`{}`))
	bad.Metadata.Set(pipeline.MetaSchemaVersion, "1")
	err := route.Handler(bad)
	fmt.Println("permanent:", pipeline.IsPermanent(err))

	// Output:
	// welcome, Ada key set: true
	// permanent: true
}
