package strictjson_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/strictjson"
)

type item struct {
	SKU string `json:"sku"`
}

type order struct {
	UserID string `json:"user_id"`
	Amount int64  `json:"amount"`
	Items  []item `json:"items"`
}

func TestDecodeRefusesWhatEncodingJSONAccepts(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		in, want string
	}{
		"invalid UTF-8":       {"{\"user_id\":\"a\xff\"}", "not valid UTF-8"},
		"duplicate key":       {`{"amount":12,"amount":99}`, "amount: is given twice"},
		"case-folded name":    {`{"AMOUNT":12}`, `AMOUNT: unknown field (did you mean "amount"?`},
		"unknown field":       {`{"amount":1,"color":"red"}`, "color: unknown field"},
		"NUL in a string":     {`{"user_id":"a\u0000b"}`, "user_id: holds a NUL character"},
		"nested duplicate":    {`{"items":[{"sku":"a","sku":"b"}]}`, "items[0].sku: is given twice"},
		"nested wrong case":   {`{"items":[{"SKU":"a"}]}`, "items[0].SKU: unknown field"},
		"two values":          {`{"amount":1} {"amount":2}`, "data after the JSON value"},
		"truncated":           {`{"amount":`, "ends too early"},
		"wrong type":          {`{"amount":"12"}`, "amount: must be a whole number in range, got string"},
		"fraction":            {`{"amount":1.5}`, "amount: must be a whole number in range"},
		"syntax":              {`{"amount":1,}`, "invalid JSON at byte"},
		"overflow":            {`{"amount":99999999999999999999}`, "amount: must be a whole number in range"},
		"array where object":  {`[1]`, "must be an object"},
		"object where string": {`{"user_id":{}}`, "user_id: must be a string"},
	} {
		t.Run(name, func(t *testing.T) {
			var o order
			err := strictjson.Decode([]byte(tc.in), &o, strictjson.Options{})
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "Go struct", "no Go type names")
			require.NotContains(t, err.Error(), "strictjson_test")
			require.False(t, strings.Contains(err.Error(), "int64"), err.Error())
		})
	}
}

func TestDecodeAcceptsCleanInput(t *testing.T) {
	t.Parallel()
	var o order
	require.NoError(t, strictjson.Decode([]byte(` {"user_id":"ü","amount":12,"items":[{"sku":"x"}]} `), &o, strictjson.Options{}))
	require.Equal(t, order{UserID: "ü", Amount: 12, Items: []item{{SKU: "x"}}}, o)

	// Events may gain fields; duplicates and case folding stay refused.
	var e order
	require.NoError(t, strictjson.Decode([]byte(`{"amount":1,"new_field":true}`), &e, strictjson.Options{AllowUnknownFields: true}))
	require.Error(t, strictjson.Decode([]byte(`{"amount":1,"amount":2}`), &e, strictjson.Options{AllowUnknownFields: true}))
	require.Error(t, strictjson.Decode([]byte(`{"Amount":1}`), &e, strictjson.Options{AllowUnknownFields: true}))

	var m map[string]any
	require.NoError(t, strictjson.Decode([]byte(`{"a":{"b":[1,"\u00e9"]}}`), &m, strictjson.Options{}))
	require.Error(t, strictjson.Decode([]byte(`{"a":{"b":1,"b":2}}`), &m, strictjson.Options{}))
}
