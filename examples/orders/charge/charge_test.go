package charge_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/examples/orders/charge"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline"
)

func TestHTTPClientChargesOncePerKey(t *testing.T) {
	t.Parallel()
	provider, err := sandbox.StartPaymentProvider("127.0.0.1:0")
	require.NoError(t, err)
	defer provider.Close()
	c, err := charge.NewHTTPClient(provider.URL())
	require.NoError(t, err)

	req := charge.Request{Amount: 100, Currency: "JPY", Customer: "u", Metadata: map[string]string{"order_id": "7"}}
	id1, err := c.Charge(context.Background(), req, "key-1")
	require.NoError(t, err)
	id2, err := c.Charge(context.Background(), req, "key-1")
	require.NoError(t, err)
	require.Equal(t, id1, id2, "a replayed key returns the first charge")
	require.Len(t, provider.Charges(), 1)
	require.Equal(t, "7", provider.Charges()[0].OrderID)

	_, err = c.Charge(context.Background(), req, "")
	require.Error(t, err, "no charge without an idempotency key")
}

func TestHTTPClientClassifiesAnswers(t *testing.T) {
	t.Parallel()
	for status, permanent := range map[int]bool{400: true, 402: true, 404: true, 409: false, 429: false, 500: false, 503: false} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(status)
			_, _ = w.Write([]byte(`{"error":"x"}`))
		}))
		c, err := charge.NewHTTPClient(srv.URL)
		require.NoError(t, err)
		_, err = c.Charge(context.Background(), charge.Request{Amount: 1}, "k")
		srv.Close()
		require.Error(t, err, "status %d", status)
		require.Equal(t, permanent, pipeline.IsPermanent(err), "status %d", status)
	}
	_, err := charge.NewHTTPClient("ftp://x")
	require.Error(t, err)
}

// A provider's refusal quotes the customer's data back (an email, a card
// number, up to a megabyte of it): the error keeps the status and the
// provider's short code, never the body, so none of it reaches logs,
// retry headers, the poison store or intent_status.
func TestProviderAnswersNeverLeakIntoErrors(t *testing.T) {
	t.Parallel()
	pii := `customer erin@example.com, card 4242424242424242, ` + strings.Repeat("x", 1<<19)
	for body, want := range map[string]string{
		`{"error":{"code":"card_declined","message":"` + pii + `"}}`: "payment provider answered 402 (card_declined)",
		`{"error":{"type":"card_error","message":"` + pii + `"}}`:    "payment provider answered 402 (card_error)",
		`{"code":"insufficient_funds","detail":"` + pii + `"}`:       "payment provider answered 402 (insufficient_funds)",
		`{"error":"` + pii + `"}`:                                    "payment provider answered 402",
		pii:                                                          "payment provider answered 402",
		"Kunde ung\xfcltig: erin@example.com":                        "payment provider answered 402",
		// What a provider puts where its code goes is a code only if it
		// looks like one: a card number, a phone number, an address is not.
		`{"error":{"code":"4242424242424242"}}`: "payment provider answered 402",
		`{"error":{"code":"4242-4242-4242"}}`:   "payment provider answered 402",
		`{"code":"erin@example.com"}`:           "payment provider answered 402",
		`{"code":"15551234567"}`:                "payment provider answered 402",
		`{"code":"acct_4242424242"}`:            "payment provider answered 402",
		`{"code":"card-4111-1111-1111-1111"}`:   "payment provider answered 402",
		`{"code":"ref-4111111111111111"}`:       "payment provider answered 402",
		`{"error":{"code":"51"}}`:               "payment provider answered 402 (51)",
		`{"error":{"code":"E1001"}}`:            "payment provider answered 402 (E1001)",
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusPaymentRequired)
			_, _ = w.Write([]byte(body))
		}))
		c, err := charge.NewHTTPClient(srv.URL)
		require.NoError(t, err)
		_, err = c.Charge(context.Background(), charge.Request{Amount: 1}, "k")
		srv.Close()
		require.EqualError(t, errors.Unwrap(err), want)
		require.NotContains(t, err.Error(), "erin@")
		require.NotContains(t, err.Error(), "4242")
	}
}
