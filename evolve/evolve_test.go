package evolve_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/pipeline"
)

// Three versions of an order event: v1 had the amount in euros as a
// float, v2 in cents, v3 nests the customer.
type placedV1 struct {
	OrderID string  `json:"order_id"`
	Euros   float64 `json:"euros"`
	Email   string  `json:"email"`
}

type placedV2 struct {
	OrderID string `json:"order_id"`
	Cents   int64  `json:"cents"`
	Email   string `json:"email"`
}

type customer struct {
	Email string `json:"email"`
}

type placedV3 struct {
	OrderID  string   `json:"order_id"`
	Cents    int64    `json:"cents"`
	Customer customer `json:"customer"`
	Note     string   `json:"note,omitempty"`
}

func (p placedV3) Validate() error {
	if p.Cents < 0 {
		return errors.New("cents must not be negative")
	}
	return nil
}

func v1to2(o placedV1) (placedV2, error) {
	return placedV2{OrderID: o.OrderID, Cents: int64(o.Euros*100 + 0.5), Email: o.Email}, nil
}

func v2to3(o placedV2) (placedV3, error) {
	return placedV3{OrderID: o.OrderID, Cents: o.Cents, Customer: customer{Email: o.Email}}, nil
}

// v0 events were written by a service in another language with "total"
// where v1 has "euros": a raw step, no Go type of v0 exists.
func v0to1(raw json.RawMessage) (json.RawMessage, error) {
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	m["euros"] = m["total"]
	delete(m, "total")
	return json.Marshal(m)
}

func chain(t *testing.T) *evolve.Chain[placedV3] {
	t.Helper()
	c, err := evolve.New[placedV3]("orders.placed", "3",
		evolve.Up("1", "2", v1to2),
		evolve.Up("2", "3", v2to3),
	)
	require.NoError(t, err)
	return c
}

func TestEveryVersionDecodesAsTheCurrentType(t *testing.T) {
	c := chain(t)
	require.Equal(t, []string{"1", "2", "3"}, c.Versions())
	for v, payload := range map[string]string{
		"1": `{"order_id":"o-1","euros":12.5,"email":"a@example.com"}`,
		"2": `{"order_id":"o-1","cents":1250,"email":"a@example.com"}`,
		"3": `{"order_id":"o-1","cents":1250,"customer":{"email":"a@example.com"}}`,
	} {
		got, err := c.Decode(v, []byte(payload))
		require.NoError(t, err, "version %s", v)
		require.Equal(t, placedV3{OrderID: "o-1", Cents: 1250, Customer: customer{Email: "a@example.com"}}, *got, "version %s", v)
		up, err := c.Upcast(v, []byte(payload))
		require.NoError(t, err)
		require.JSONEq(t, `{"order_id":"o-1","cents":1250,"customer":{"email":"a@example.com"}}`, string(up))
	}
}

func TestRawStepsAndTypedStepsMix(t *testing.T) {
	c, err := evolve.New[placedV3]("orders.placed", "3",
		evolve.Raw("0", "1", v0to1), evolve.Up("1", "2", v1to2), evolve.Up("2", "3", v2to3))
	require.ErrorContains(t, err, `version "0" is not a positive integer`)
	require.Nil(t, c)

	// Versions are positive: the first is 1. Here v1 is raw-only, v2 typed.
	c2, err := evolve.New[placedV3]("orders.placed", "3",
		evolve.Raw("1", "2", func(raw json.RawMessage) (json.RawMessage, error) {
			var m map[string]any
			if err := json.Unmarshal(raw, &m); err != nil {
				return nil, err
			}
			m["cents"] = m["euros"].(float64) * 100
			delete(m, "euros")
			return json.Marshal(m)
		}),
		evolve.Up("2", "3", v2to3),
		evolve.RawDown("4", "3", func(raw json.RawMessage) (json.RawMessage, error) { return raw, nil }),
	)
	require.NoError(t, err)
	require.Equal(t, []string{"1", "2", "3", "4"}, c2.Versions())
	got, err := c2.Decode("1", []byte(`{"order_id":"o-2","euros":3,"email":"b@example.com"}`))
	require.NoError(t, err)
	require.Equal(t, placedV3{OrderID: "o-2", Cents: 300, Customer: customer{Email: "b@example.com"}}, *got)
	// A newer producer's v4 reaches this consumer through the down step.
	got, err = c2.Decode("4", []byte(`{"order_id":"o-2","cents":300,"customer":{"email":"b@example.com"},"gift":true}`))
	require.NoError(t, err)
	require.Equal(t, "o-2", got.OrderID)
}

func TestAChainThatCannotWorkIsRefusedAtStartNamingTheStep(t *testing.T) {
	for name, tc := range map[string]struct {
		steps []evolve.Step
		want  string
	}{
		"gap": {[]evolve.Step{evolve.Up("1", "2", v1to2)}, "a gap: up step 1→2 leads to version 2, and no step continues from it to the current version 3"},
		"duplicate": {[]evolve.Step{evolve.Up("1", "2", v1to2), evolve.Up("2", "3", v2to3), evolve.Up("2", "3", v2to3)},
			"up step 2→3 duplicates up step 2→3"},
		"wrong way": {[]evolve.Step{evolve.Up("3", "2", func(placedV3) (placedV2, error) { return placedV2{}, nil })}, "up step 3→2 goes the wrong way"},
		"types disagree": {[]evolve.Step{evolve.Up("1", "2", func(placedV1) (placedV1, error) { return placedV1{}, nil }), evolve.Up("2", "3", v2to3)},
			"version 2 is evolve_test.placedV1 out of up step 1→2 but evolve_test.placedV2 into up step 2→3"},
		"not the handler's type": {[]evolve.Step{evolve.Up("2", "3", func(placedV2) (placedV2, error) { return placedV2{}, nil })},
			"up step 2→3 produces evolve_test.placedV2, but the current version 3 is evolve_test.placedV3"},
		"down below current": {[]evolve.Step{evolve.Down("2", "1", func(placedV2) (placedV1, error) { return placedV1{}, nil })}, "down step 2→1 starts at or below the current version 3"},
		"zero step":          {[]evolve.Step{{From: "1", To: "2"}}, "not made by Up, Down, Raw or RawDown"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := evolve.New[placedV3]("orders.placed", "3", tc.steps...)
			require.ErrorContains(t, err, `event type "orders.placed"`)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := evolve.New[placedV3]("orders.placed", "v3")
	require.ErrorContains(t, err, `current version "v3" is not a positive integer`)
}

func TestWhatCannotBeUpcastIsPermanentWithItsReason(t *testing.T) {
	c, err := evolve.New[placedV3]("orders.placed", "3",
		evolve.Up("1", "2", func(o placedV1) (placedV2, error) {
			if o.Euros < 0 {
				return placedV2{}, errors.New("a negative amount has no v2")
			}
			return v1to2(o)
		}),
		evolve.Up("2", "3", v2to3))
	require.NoError(t, err)
	msg := func(v, payload string) *message.Message {
		m := message.NewMessage("m-1", []byte(payload))
		if v != "" {
			m.Metadata.Set(pipeline.MetaSchemaVersion, v)
		}
		return m
	}
	for _, tc := range []struct{ version, payload, want string }{
		{"1", `{"order_id":"o","euros":-1}`, `up step 1→2: a negative amount has no v2`},
		{"9", `{}`, `version "9": no step reaches the current version from this version 3 (it reads 1, 2, 3)`},
		{"", `{}`, `has no schema_version`},
		{"2", `{"order_id":"o","cents":"12"}`, `decoding version 2 for up step 2→3`},
		{"3", `{"order_id":"o","cents":-5}`, `invalid as version 3: cents must not be negative`},
		{"3", `{"order_id":"o","order_id":"p"}`, `order_id: is given twice`},
	} {
		_, err := c.DecodeMessage(msg(tc.version, tc.payload))
		require.Error(t, err, tc.payload)
		require.True(t, pipeline.IsPermanent(err), "%s: %v", tc.payload, err)
		require.Contains(t, err.Error(), tc.want)
	}
}

func TestProducersStampTheCurrentVersion(t *testing.T) {
	msg, err := chain(t).NewEvent(context.Background(), "o-1", placedV3{OrderID: "o-1"})
	require.NoError(t, err)
	require.Equal(t, "3", msg.Metadata.Get(pipeline.MetaSchemaVersion))
	require.Equal(t, "o-1", msg.Metadata.Get(pipeline.MetaAggregateID))
	require.True(t, strings.Contains(string(msg.Payload), `"customer"`))
}

// The typed hops run without a JSON round trip between them: one decode,
// two function calls.
func BenchmarkUpcastTwoHops1KiB(b *testing.B) {
	c, _ := evolve.New[placedV3]("orders.placed", "3", evolve.Up("1", "2", v1to2), evolve.Up("2", "3", v2to3))
	payload := []byte(`{"order_id":"o-1","euros":12.5,"email":"` + strings.Repeat("a", 950) + `@example.com"}`)
	for b.Loop() {
		if _, err := c.Decode("1", payload); err != nil {
			b.Fatal(err)
		}
	}
}

// The same payload size at the current version: no hop. The difference
// with BenchmarkUpcastTwoHops1KiB is what the two hops cost.
func BenchmarkDecodeCurrent1KiB(b *testing.B) {
	c, _ := evolve.New[placedV3]("orders.placed", "3", evolve.Up("1", "2", v1to2), evolve.Up("2", "3", v2to3))
	payload := []byte(`{"order_id":"o-1","cents":1250,"customer":{"email":"` + strings.Repeat("a", 939) + `@example.com"}}`)
	for b.Loop() {
		if _, err := c.Decode("3", payload); err != nil {
			b.Fatal(err)
		}
	}
}
