package sandbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Charge is a charge the provider made.
type Charge struct {
	ID             string
	IdempotencyKey string
	Amount         int64
	Currency       string
	Customer       string
	OrderID        string
	// TraceID is the trace id of the request's traceparent header, if any.
	TraceID string
	// At is when the charge was made (its first request): a run measures
	// commit → effect from it.
	At time.Time
}

// PaymentProvider is a Stripe-like payment API: POST /v1/charges with an
// Idempotency-Key. Like the real thing, a repeated key returns the first
// charge instead of charging again; Requests counts every call anyway.
type PaymentProvider struct {
	srv *http.Server
	ln  net.Listener

	mu       sync.Mutex
	charges  []Charge
	byKey    map[string]Charge
	requests int
	byKeyN   map[string]int // requests per idempotency key
	failures int            // answer 503 to this many next requests
	// garbage, if set, is the body of those answers instead of the usual
	// JSON (FailNextWithGarbage).
	garbage  []byte
	delay    time.Duration // before each charge answer (SetDelay)
	audit    []AuditEntry
	auditKey map[string]bool
	// replays count requests for a key whose effect was already made: a
	// handler that ran its effect twice (Replays).
	chargeReplays, auditReplays int
}

// AuditEntry is one audit event as first received (replays are dropped by
// idempotency key, as a real receiver would).
type AuditEntry struct {
	Aggregate string `json:"aggregate"`
	Seq       int64  `json:"seq"`
}

// StartPaymentProvider listens on addr ("127.0.0.1:0" for any free port).
func StartPaymentProvider(addr string) (*PaymentProvider, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("starting payment provider: %w", err)
	}
	p := &PaymentProvider{ln: ln, byKey: map[string]Charge{}, byKeyN: map[string]int{}, auditKey: map[string]bool{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/charges", p.handleCharge)
	mux.HandleFunc("POST /v1/audit", p.handleAudit)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

// URL is the provider's base URL.
func (p *PaymentProvider) URL() string { return "http://" + p.ln.Addr().String() }

// Close stops the provider.
func (p *PaymentProvider) Close() error { return p.srv.Close() }

// FailNext makes the next n requests answer 503, as an overloaded provider would.
func (p *PaymentProvider) FailNext(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failures, p.garbage = n, nil
}

// FailNextWithGarbage makes the next n requests answer 503 with body, as
// a provider whose gateway answers in its own encoding does (Latin-1, a
// NUL): whatever a handler makes of such an answer must stay storable.
func (p *PaymentProvider) FailNextWithGarbage(n int, body []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failures, p.garbage = n, body
}

// SetDelay makes every charge answer wait d, as a slow provider does:
// consumers then fall behind, and messages wait in the broker.
func (p *PaymentProvider) SetDelay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

// MaxRequestsPerKey is the most charge requests that arrived for one
// idempotency key, retries and replays included: a message retried in a
// hot loop shows here.
func (p *PaymentProvider) MaxRequestsPerKey() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	most := 0
	for _, n := range p.byKeyN {
		most = max(most, n)
	}
	return most
}

// Charges returns the charges made, in order.
func (p *PaymentProvider) Charges() []Charge {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Charge(nil), p.charges...)
}

// Requests returns how many charge requests arrived, replays included.
func (p *PaymentProvider) Requests() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.requests
}

func (p *PaymentProvider) handleCharge(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Amount   int64             `json:"amount"`
		Currency string            `json:"currency"`
		Customer string            `json:"customer"`
		Metadata map[string]string `json:"metadata"`
	}
	key := r.Header.Get("Idempotency-Key")
	err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req)
	switch {
	case err != nil:
		err = fmt.Errorf("invalid JSON: %w", err)
	case key == "":
		err = errors.New("Idempotency-Key header is required")
	case req.Amount <= 0:
		err = errors.New("amount must be positive")
	}
	if err != nil {
		writeProviderJSON(w, http.StatusBadRequest, providerError("invalid_request", err.Error()))
		return
	}

	p.mu.Lock()
	delay := p.delay
	p.mu.Unlock()
	if delay > 0 {
		select {
		case <-r.Context().Done():
			return
		case <-time.After(delay):
		}
	}
	p.mu.Lock()
	p.requests++
	p.byKeyN[key]++
	if p.failures > 0 {
		p.failures--
		garbage := p.garbage
		if p.failures == 0 {
			p.garbage = nil
		}
		p.mu.Unlock()
		if garbage != nil {
			w.Header().Set("Content-Type", "text/plain; charset=iso-8859-1")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write(garbage)
			return
		}
		writeProviderJSON(w, http.StatusServiceUnavailable, providerError("unavailable", "try again later"))
		return
	}
	c, replay := p.byKey[key]
	if replay {
		p.chargeReplays++
	} else {
		c = Charge{
			ID: fmt.Sprintf("ch_%06d", len(p.charges)+1), IdempotencyKey: key,
			Amount: req.Amount, Currency: req.Currency, Customer: req.Customer, OrderID: req.Metadata["order_id"],
			TraceID: traceIDOf(r.Header.Get("traceparent")), At: time.Now(),
		}
		p.charges = append(p.charges, c)
		p.byKey[key] = c
	}
	p.mu.Unlock()
	writeProviderJSON(w, http.StatusOK, map[string]any{"id": c.ID, "amount": c.Amount, "currency": c.Currency, "replayed": replay})
}

// Replays counts the requests, charges and audit events, that came again
// for an idempotency key already done: each is a handler that ran its
// effect a second time (the key kept the effect single).
func (p *PaymentProvider) Replays() (charges, audits int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.chargeReplays, p.auditReplays
}

// Audit returns the audit events in the order they first arrived.
func (p *PaymentProvider) Audit() []AuditEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]AuditEntry(nil), p.audit...)
}

func (p *PaymentProvider) handleAudit(w http.ResponseWriter, r *http.Request) {
	var e AuditEntry
	key := r.Header.Get("Idempotency-Key")
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<12)).Decode(&e); err != nil || key == "" {
		writeProviderJSON(w, http.StatusBadRequest, map[string]string{"error": "want JSON {aggregate, seq} and an Idempotency-Key"})
		return
	}
	p.mu.Lock()
	if !p.auditKey[key] {
		p.auditKey[key] = true
		p.audit = append(p.audit, e)
	} else {
		p.auditReplays++
	}
	p.mu.Unlock()
	writeProviderJSON(w, http.StatusOK, map[string]string{"ok": "recorded"})
}

func writeProviderJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// providerError is a Stripe-like error answer: a code for programs, a
// message for people (which, at a real provider, may quote the customer's
// data back).
func providerError(code, message string) map[string]any {
	return map[string]any{"error": map[string]string{"code": code, "message": message}}
}

// traceIDOf is the trace id of a W3C traceparent ("00-<trace>-<span>-<flags>").
func traceIDOf(tp string) string {
	parts := strings.Split(tp, "-")
	if len(parts) != 4 || len(parts[1]) != 32 {
		return ""
	}
	return parts[1]
}
