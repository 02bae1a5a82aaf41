package charge_test

import (
	"context"
	"net/http"
	"net/http/httptest"
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
