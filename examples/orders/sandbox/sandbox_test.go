package sandbox_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/smtp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/examples/orders/sandbox"
)

// The sandbox is the chaos runs' measuring instrument: a charge counted
// twice, a replay not counted or an audit event recorded out of arrival
// order would make a run report what did not happen. These pin what each
// server says to what it was sent.

func charge(t *testing.T, p *sandbox.PaymentProvider, key, body string) (int, map[string]any, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.URL()+"/v1/charges", strings.NewReader(body))
	require.NoError(t, err)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var out map[string]any
	_ = json.Unmarshal(raw, &out)
	return resp.StatusCode, out, string(raw)
}

func TestTheProviderChargesOncePerKeyAndCountsEveryRequest(t *testing.T) {
	p, err := sandbox.StartPaymentProvider("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	const body = `{"amount": 1200, "currency": "JPY", "customer": "u1", "metadata": {"order_id": "7"}}`

	before := time.Now()
	code, first, _ := charge(t, p, "k1", body)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, false, first["replayed"])
	code, again, _ := charge(t, p, "k1", body)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, true, again["replayed"], "a repeated key is a replay")
	require.Equal(t, first["id"], again["id"], "a replay answers with the first charge")

	charges := p.Charges()
	require.Len(t, charges, 1, "one charge per key")
	c := charges[0]
	require.Equal(t, "7", c.OrderID)
	require.Equal(t, int64(1200), c.Amount)
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", c.TraceID)
	require.False(t, c.At.Before(before), "stamped when made")
	require.Equal(t, 2, p.Requests())
	require.Equal(t, 2, p.MaxRequestsPerKey())
	replays, _ := p.Replays()
	require.Equal(t, 1, replays)

	// Refused before anything is counted: no key, no positive amount.
	code, _, _ = charge(t, p, "", body)
	require.Equal(t, http.StatusBadRequest, code)
	code, _, _ = charge(t, p, "k2", `{"amount": 0}`)
	require.Equal(t, http.StatusBadRequest, code)
	require.Equal(t, 2, p.Requests())
}

func TestTheProviderFailsWhatItIsToldToAndNoMore(t *testing.T) {
	p, err := sandbox.StartPaymentProvider("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	const body = `{"amount": 5, "currency": "USD", "metadata": {"order_id": "1"}}`

	p.FailNext(2)
	for range 2 {
		code, _, _ := charge(t, p, "k", body)
		require.Equal(t, http.StatusServiceUnavailable, code)
	}
	code, _, _ := charge(t, p, "k", body)
	require.Equal(t, http.StatusOK, code, "only the next two fail")
	require.Len(t, p.Charges(), 1)

	garbage := []byte("abgelehnt: ung\xfcltig\x00")
	p.FailNextWithGarbage(1, garbage)
	code, _, raw := charge(t, p, "k3", body)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, string(garbage), raw, "the answer's bytes as given, not valid UTF-8")
	code, _, _ = charge(t, p, "k3", body)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, 5, p.Requests(), "failed requests count too")
}

func TestTheProviderKeepsAuditEventsInArrivalOrderOncePerKey(t *testing.T) {
	p, err := sandbox.StartPaymentProvider("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	post := func(key string, seq int) {
		body, _ := json.Marshal(sandbox.AuditEntry{Aggregate: "a", Seq: int64(seq)})
		req, err := http.NewRequest(http.MethodPost, p.URL()+"/v1/audit", bytes.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	post("e0", 0)
	post("e2", 2) // out of order, as a broken ordered route would send it
	post("e1", 1)
	post("e2", 2) // a replay: dropped, counted
	require.Equal(t, []sandbox.AuditEntry{{"a", 0}, {"a", 2}, {"a", 1}}, p.Audit())
	_, audits := p.Replays()
	require.Equal(t, 1, audits)
}

func TestTheSinkKeepsEveryMailWithItsHeaders(t *testing.T) {
	s, err := sandbox.StartSMTPSink("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	send := func(id string) {
		msg := "Message-ID: <" + id + "@ferry>\r\nSubject: Your order #9\r\n\r\nhello\r\n"
		require.NoError(t, smtp.SendMail(s.Addr(), nil, "shop@example.com", []string{"u@example.com"}, []byte(msg)))
	}
	var wg sync.WaitGroup
	for _, id := range []string{"m1", "m2", "m1"} {
		wg.Go(func() { send(id) })
	}
	wg.Wait()
	mails := s.Mails()
	require.Len(t, mails, 3, "the sink keeps duplicates: the reader dedupes by Message-ID")
	ids := map[string]int{}
	for _, m := range mails {
		require.Equal(t, "Your order #9", m.Subject)
		require.Equal(t, "shop@example.com", m.From)
		require.Equal(t, []string{"u@example.com"}, m.To)
		ids[m.MessageID]++
	}
	require.Equal(t, map[string]int{"<m1@ferry>": 2, "<m2@ferry>": 1}, ids)
}
