package orders_test

import (
	"bytes"
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/ferry-dev/ferry/examples/orders/orders"
)

// FuzzParseCreateOrder: whatever the body, parsing and validating never
// panics, and what passes validation is within create_order's bounds, so no
// request body can smuggle a bad order past the checks.
func FuzzParseCreateOrder(f *testing.F) {
	f.Add([]byte(`{"user_id":"alice","amount":1200,"currency":"JPY"}`), "k-1")
	f.Add([]byte(`{"user_id":"x'); DROP TABLE orders;--","amount":-1,"currency":"EUR"}`), "k")
	f.Add([]byte("{\"user_id\":\"\xff\",\"amount\":1,\"currency\":\"USD\"}"), "k")
	f.Add([]byte(`{"user_id":"a","amount":1e30,"currency":"USD"}`), "")
	f.Add([]byte(`[]`), "k")
	f.Fuzz(func(t *testing.T, body []byte, key string) {
		in, err := orders.ParseCreateOrder(bytes.NewReader(body), key)
		if err != nil {
			return
		}
		verr := in.Validate()
		if verr == nil {
			if in.Amount <= 0 || in.Amount > orders.MaxAmount {
				t.Fatalf("amount %d passed validation", in.Amount)
			}
			if in.Currency != orders.CurrencyJPY && in.Currency != orders.CurrencyUSD {
				t.Fatalf("currency %q passed validation", in.Currency)
			}
			if !utf8.ValidString(in.UserID) || in.UserID == "" || len(in.UserID) > orders.MaxUserIDLength {
				t.Fatalf("user id %q passed validation", in.UserID)
			}
			if in.IdempotencyKey == "" || !utf8.ValidString(in.IdempotencyKey) {
				t.Fatalf("idempotency key %q passed validation", in.IdempotencyKey)
			}
		} else if !errors.Is(verr, orders.ErrInvalidInput) {
			t.Fatalf("validation error of the wrong kind: %v", verr)
		}
	})
}
