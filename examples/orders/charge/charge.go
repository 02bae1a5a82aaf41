// Package charge is the stripe.charge consumer: it charges an order through
// a payment provider's HTTP API, with the message's idempotency key so that
// a redelivery never charges twice.
package charge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"time"

	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/tracing"
)

// HandlerName is the route name (and queue name) of the charge handler.
const HandlerName = "payments.charge"

// DefaultTimeout bounds one call to the provider.
const DefaultTimeout = 10 * time.Second

// Request is one charge sent to the provider.
type Request struct {
	Amount   int64             `json:"amount"`
	Currency string            `json:"currency"`
	Customer string            `json:"customer"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// Charger makes a charge; the same idempotency key must never charge twice.
type Charger interface {
	Charge(ctx context.Context, req Request, idempotencyKey string) (chargeID string, err error)
}

// Route is the stripe.charge route, charging through c.
func Route(c Charger, logger *slog.Logger) handlers.Route {
	return RouteOf(orders.ChargeEvents, func(e *orders.ChargeRequested) orders.ChargeRequested { return *e }, c, logger)
}

// RouteOf is Route for code that reads the charge event as another
// version's type T (chain's current one): as turns it into the charge to
// make. A rolling deploy runs old and new code at once, each with its own.
func RouteOf[T any](chain *evolve.Chain[T], as func(*T) orders.ChargeRequested, c Charger, logger *slog.Logger) handlers.Route {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return handlers.Route{
		Name:  HandlerName,
		Topic: orders.TopicChargeRequested,
		// A charge and a later refund of one order must not swap places.
		Ordered: true,
		Handler: handlers.Evolving(chain, func(ctx context.Context, v *T) error {
			e := as(v)
			key, err := handlers.IdempotencyKey(ctx)
			if err != nil {
				return err
			}
			id, err := c.Charge(ctx, Request{
				Amount: e.Amount, Currency: e.Currency, Customer: e.UserID,
				Metadata: map[string]string{"order_id": fmt.Sprint(e.OrderID)},
			}, key)
			if err != nil {
				return fmt.Errorf("charging order %d: %w", e.OrderID, err)
			}
			logger.InfoContext(ctx, "order charged", "order_id", e.OrderID, "charge_id", id)
			return nil
		}),
	}
}

// HTTPClient calls a Stripe-like payment API: POST {BaseURL}/v1/charges
// with a JSON body and an Idempotency-Key header, answering {"id": "..."}.
type HTTPClient struct {
	BaseURL string
	HTTP    *http.Client
}

// NewHTTPClient returns a client of the provider at baseURL.
func NewHTTPClient(baseURL string) (*HTTPClient, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("payment provider URL must be an http(s) URL, got %q", baseURL)
	}
	// The request is a client span of the message's trace and carries its
	// traceparent to the provider.
	return &HTTPClient{BaseURL: baseURL, HTTP: &http.Client{Timeout: DefaultTimeout, Transport: tracing.Transport(nil)}}, nil
}

// StatusError is the provider's refusal: its HTTP status and the short
// error code it gave ("card_declined"), nothing else. The answer's body is
// never kept: a provider quotes the customer's data back in it (an email,
// a card number), and this error goes into logs, retry headers, the
// poison store and intent_status.
type StatusError struct {
	Status int
	// Code is the provider's error code when it gave one that looks like a
	// code (see looksLikeCode), else "".
	Code string
}

func (e *StatusError) Error() string {
	if e.Code == "" {
		return fmt.Sprintf("payment provider answered %d", e.Status)
	}
	return fmt.Sprintf("payment provider answered %d (%s)", e.Status, e.Code)
}

var codeLike = regexp.MustCompile(`^(?:[A-Za-z][A-Za-z0-9_.-]{0,63}|[0-9]{1,4})$`)

// looksLikeCode: a word-like code ("card_declined", "E1001": starting with
// a letter, letters, digits and _ . -, at most 64 bytes, fewer than five
// digits in all) or a short numeric one ("05", "51", ISO 8583's). A card
// number, a phone number or a mail address a provider put where its code
// goes is not a code, and never reaches an error text: counted in all,
// the digits of card-4111-1111-1111-1111 give it away, which no run of
// five does.
func looksLikeCode(s string) bool {
	digits := 0
	for _, c := range s {
		if c >= '0' && c <= '9' {
			digits++
		}
	}
	return codeLike.MatchString(s) && digits < 5
}

// errorCode finds a provider's error code in its answer: Stripe's
// {"error": {"code": ...}} (or "type"), or a top-level "code" or "error"
// string, when it looks like a code.
func errorCode(body []byte) string {
	var v struct {
		Code  any `json:"code"`
		Error any `json:"error"`
	}
	if json.Unmarshal(body, &v) != nil {
		return ""
	}
	var candidates []any
	if m, ok := v.Error.(map[string]any); ok {
		candidates = append(candidates, m["code"], m["type"])
	}
	candidates = append(candidates, v.Code, v.Error)
	for _, c := range candidates {
		if s, ok := c.(string); ok && looksLikeCode(s) {
			return s
		}
	}
	return ""
}

// Charge implements Charger. A 4xx answer other than 408, 409 and 429 is
// Permanent: the provider has judged the request itself, and asking again
// gets the same answer.
func (c *HTTPClient) Charge(ctx context.Context, req Request, idempotencyKey string) (string, error) {
	if idempotencyKey == "" {
		return "", errors.New("refusing to charge without an idempotency key")
	}
	body, err := json.Marshal(req)
	if err != nil {
		return "", fmt.Errorf("encoding charge: %w", err)
	}
	httpReq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+"/v1/charges", bytes.NewReader(body))
	if err != nil {
		return "", fmt.Errorf("building charge request: %w", err)
	}
	httpReq.Header.Set("Content-Type", "application/json")
	httpReq.Header.Set("Idempotency-Key", idempotencyKey)
	resp, err := c.HTTP.Do(httpReq)
	if err != nil {
		return "", fmt.Errorf("calling payment provider: %w", err)
	}
	defer resp.Body.Close()
	respBody, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return "", fmt.Errorf("reading payment provider answer: %w", err)
	}
	if resp.StatusCode/100 != 2 {
		serr := &StatusError{Status: resp.StatusCode, Code: errorCode(respBody)}
		switch {
		case resp.StatusCode == http.StatusRequestTimeout, resp.StatusCode == http.StatusConflict,
			resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode >= 500:
			return "", serr
		default:
			return "", pipeline.Permanent(serr)
		}
	}
	var out struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(respBody, &out); err != nil || out.ID == "" {
		return "", fmt.Errorf("payment provider answered %d without a charge id", resp.StatusCode)
	}
	return out.ID, nil
}
