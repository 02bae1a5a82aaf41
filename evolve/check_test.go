package evolve_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/evolve"
)

// The fixtures: version 1 of a signup event as recorded, and the changes
// a developer might make to it in place.
type signupV1 struct {
	UserID string `json:"user_id"`
	Email  string `json:"email"`
	Plan   string `json:"plan,omitempty"`
	Seats  int    `json:"seats"`
}

type signupAddedOptional struct {
	UserID   string  `json:"user_id"`
	Email    string  `json:"email"`
	Plan     string  `json:"plan,omitempty"`
	Seats    int     `json:"seats"`
	Referrer *string `json:"referrer"`
	Locale   string  `json:"locale,omitempty"`
}

type signupRemovedRequired struct {
	UserID string `json:"user_id"`
	Plan   string `json:"plan,omitempty"`
	Seats  int    `json:"seats"`
}

type signupChangedType struct {
	UserID string `json:"user_id"`
	Email  string `json:"email"`
	Plan   string `json:"plan,omitempty"`
	Seats  string `json:"seats"`
}

type signupRenamed struct {
	UserID  string `json:"user_id"`
	Address string `json:"email_address"`
	Plan    string `json:"plan,omitempty"`
	Seats   int    `json:"seats"`
}

type signupAddedRequired struct {
	UserID string `json:"user_id"`
	Email  string `json:"email"`
	Plan   string `json:"plan,omitempty"`
	Seats  int    `json:"seats"`
	Region string `json:"region"`
}

func recorded(t *testing.T) evolve.Snapshot {
	t.Helper()
	c, err := evolve.New[signupV1]("users.signed_up", "1")
	require.NoError(t, err)
	return evolve.Take([]evolve.Schema{c}, evolve.Snapshot{})
}

func check[T any](t *testing.T, previous evolve.Snapshot, mode evolve.Mode, current string, steps ...evolve.Step) []string {
	t.Helper()
	c, err := evolve.New[T]("users.signed_up", current, steps...)
	require.NoError(t, err)
	var out []string
	for _, v := range evolve.Check(previous, []evolve.Schema{c}, mode) {
		out = append(out, v.String())
	}
	return out
}

func TestSchemaCheckCatchesWhatBreaksStoredEvents(t *testing.T) {
	prev := recorded(t)
	require.Equal(t, evolve.Fields{
		"user_id": {Type: "string", Required: true}, "email": {Type: "string", Required: true},
		"plan": {Type: "string"}, "seats": {Type: "integer", Required: true},
	}, prev.Types["users.signed_up"].Versions["1"])

	require.Empty(t, check[signupAddedOptional](t, prev, evolve.DefaultMode, "1"), "an added optional field passes")
	require.Equal(t, []string{"users.signed_up version 1 field email: required field removed: events of this version carry it and this type drops it, and consumers of this version count on it: a rename or a removal is a new version with a step"},
		check[signupRemovedRequired](t, prev, evolve.DefaultMode, "1"))
	require.Equal(t, []string{"users.signed_up version 1 field seats: type changed: from integer to string: events stored as integer no longer decode; a new version with a step converts them"},
		check[signupChangedType](t, prev, evolve.DefaultMode, "1"))
	renamed := check[signupRenamed](t, prev, evolve.DefaultMode, "1")
	require.Len(t, renamed, 2, "a rename is a removal and an addition: %v", renamed)
	require.Contains(t, renamed[0], "field email: required field removed")
	require.Contains(t, renamed[1], "field email_address: required field added")
	require.Len(t, check[signupAddedRequired](t, prev, evolve.DefaultMode, "1"), 1)
	// FORWARD: old consumers read new events; an added required field is fine for them.
	require.Empty(t, check[signupAddedRequired](t, prev, evolve.Forward, "1"))
	require.Empty(t, check[signupChangedType](t, prev, evolve.None, "1"))

	// The same rename as a new version with a step passes.
	require.Empty(t, check[signupRenamed](t, prev, evolve.DefaultMode, "2",
		evolve.Up("1", "2", func(o signupV1) (signupRenamed, error) {
			return signupRenamed{UserID: o.UserID, Address: o.Email, Plan: o.Plan, Seats: o.Seats}, nil
		})))
	// A new version without a step from the stored one fails, naming it.
	got := check[signupRenamed](t, prev, evolve.DefaultMode, "2")
	require.Len(t, got, 1)
	require.Contains(t, got[0], "users.signed_up version 1: no step: events of version 1 may be stored and no step takes them to version 2")
	// FORWARD says who must deploy first.
	got = check[signupRenamed](t, prev, evolve.Forward, "2", evolve.Up("1", "2", func(o signupV1) (signupRenamed, error) { return signupRenamed{}, nil }))
	require.Len(t, got, 1)
	require.Contains(t, got[0], "consumers behind")
}

// TRANSITIVE holds for every recorded version: v1 is recorded, v2 was
// added with a step, and v3 brings v2 along but forgets v1.
func TestTransitiveModesCheckEveryRecordedVersion(t *testing.T) {
	prev := recorded(t)
	c2, err := evolve.New[signupRenamed]("users.signed_up", "2", evolve.Up("1", "2", func(o signupV1) (signupRenamed, error) { return signupRenamed{}, nil }))
	require.NoError(t, err)
	require.Empty(t, evolve.Check(prev, []evolve.Schema{c2}, evolve.DefaultMode))
	prev = evolve.Take([]evolve.Schema{c2}, prev)
	require.Len(t, prev.Types["users.signed_up"].Versions, 2, "the snapshot keeps every version")

	type signupV3 struct {
		UserID string `json:"user_id"`
	}
	c3, err := evolve.New[signupV3]("users.signed_up", "3",
		evolve.Raw("2", "3", func(raw json.RawMessage) (json.RawMessage, error) { return raw, nil }))
	require.NoError(t, err)
	_, err = evolve.New[signupV3]("users.signed_up", "3", evolve.Raw("2", "3", nil))
	require.ErrorContains(t, err, "its function is nil")
	var transitive, last []string
	for _, v := range evolve.Check(prev, []evolve.Schema{c3}, evolve.BackwardTransitive) {
		transitive = append(transitive, v.String())
	}
	for _, v := range evolve.Check(prev, []evolve.Schema{c3}, evolve.Backward) {
		last = append(last, v.String())
	}
	require.Len(t, transitive, 1)
	require.True(t, strings.HasPrefix(transitive[0], "users.signed_up version 1: no step"), transitive[0])
	require.Empty(t, last, "BACKWARD looks at the last version only")

	// A type gone from the code, and a version that went back.
	require.Contains(t, evolve.Check(prev, nil, evolve.DefaultMode)[0].String(), "event type removed")
	c1, err := evolve.New[signupV1]("users.signed_up", "1")
	require.NoError(t, err)
	require.Contains(t, evolve.Check(prev, []evolve.Schema{c1}, evolve.DefaultMode)[0].String(), "version went back")
}

// Nested fixtures: an order with a customer object and an array of lines,
// as recorded, and the same type with a field dropped or retyped inside
// them. The check reads nested fields by path: a change inside an object
// or an array's items breaks stored events as one at the top does.
type orderCustomerV1 struct {
	ID    string `json:"id"`
	Email string `json:"email"`
}

type orderLineV1 struct {
	SKU string `json:"sku"`
	Qty int    `json:"qty"`
}

type orderV1 struct {
	OrderID  string          `json:"order_id"`
	Customer orderCustomerV1 `json:"customer"`
	Lines    []orderLineV1   `json:"lines"`
}

type orderCustomerNoEmail struct {
	ID string `json:"id"`
}

type orderDroppedNested struct {
	OrderID  string               `json:"order_id"`
	Customer orderCustomerNoEmail `json:"customer"`
	Lines    []orderLineV1        `json:"lines"`
}

type orderLineQtyText struct {
	SKU string `json:"sku"`
	Qty string `json:"qty"`
}

type orderRetypedInArray struct {
	OrderID  string             `json:"order_id"`
	Customer orderCustomerV1    `json:"customer"`
	Lines    []orderLineQtyText `json:"lines"`
}

func TestSchemaCheckReadsNestedFields(t *testing.T) {
	c, err := evolve.New[orderV1]("orders.placed", "1")
	require.NoError(t, err)
	prev := evolve.Take([]evolve.Schema{c}, evolve.Snapshot{})
	require.Equal(t, evolve.Fields{
		"order_id": {Type: "string", Required: true}, "customer": {Type: "object", Required: true},
		"customer.id": {Type: "string", Required: true}, "customer.email": {Type: "string", Required: true},
		"lines": {Type: "array", Required: true}, "lines[].sku": {Type: "string", Required: true}, "lines[].qty": {Type: "integer", Required: true},
	}, prev.Types["orders.placed"].Versions["1"])
	checkOrder := func(s evolve.Schema) []string {
		var out []string
		for _, v := range evolve.Check(prev, []evolve.Schema{s}, evolve.DefaultMode) {
			out = append(out, v.String())
		}
		return out
	}
	dropped, err := evolve.New[orderDroppedNested]("orders.placed", "1")
	require.NoError(t, err)
	got := checkOrder(dropped)
	require.Len(t, got, 1, "%v", got)
	require.Contains(t, got[0], "orders.placed version 1 field customer.email: required field removed")
	retyped, err := evolve.New[orderRetypedInArray]("orders.placed", "1")
	require.NoError(t, err)
	got = checkOrder(retyped)
	require.Len(t, got, 1, "%v", got)
	require.Contains(t, got[0], "orders.placed version 1 field lines[].qty: type changed: from integer to string")
}
