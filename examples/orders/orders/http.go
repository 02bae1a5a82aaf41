package orders

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strings"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/strictjson"
)

// MaxRequestBytes bounds a create_order request body.
const MaxRequestBytes = 64 << 10

// Request and correlation headers of the HTTP API.
const (
	HeaderIdempotencyKey = "Idempotency-Key"
	HeaderCorrelationID  = "X-Correlation-ID"
	HeaderTraceParent    = "traceparent"
)

// createOrderRequest is the JSON body of POST /orders.
type createOrderRequest struct {
	UserID   string `json:"user_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// APIError is the JSON error body of the HTTP API.
type APIError struct {
	Code    string            `json:"code"`
	Message string            `json:"message"`
	Fields  map[string]string `json:"fields,omitempty"`
}

// ToolCaller runs a tool (agenttools.Runner does).
type ToolCaller interface {
	Call(ctx context.Context, name, key string, args json.RawMessage) (*agenttools.Result, error)
}

// Handler returns the HTTP API, a thin wrapper over the create_order tool
// (CreateOrderTool) run by tools: POST /orders with an Idempotency-Key
// header and a JSON body {"user_id", "amount", "currency"}. It answers 201
// with {"order_id", "deduped": false} for a new order, 200 with "deduped":
// true for a repeated key, and a JSON {"error": {...}} with 400, 413, 415 or
// 422 for input it refuses (nothing is written then); unknown paths and
// methods get 404 and 405 in the same envelope.
func Handler(call ToolCaller, logger *slog.Logger) http.Handler {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		corr := r.Header.Get(HeaderCorrelationID)
		if strings.IndexFunc(corr, func(c rune) bool { return c < 0x21 || c > 0x7e }) >= 0 {
			// It travels in every event's headers: printable ASCII only.
			writeError(w, http.StatusBadRequest, APIError{Code: "invalid_correlation_id", Message: HeaderCorrelationID + " must be printable ASCII without spaces"})
			return
		}
		if corr == "" || len(corr) > 128 {
			corr = watermill.NewUUID()
		}
		w.Header().Set(HeaderCorrelationID, corr)
		ctx := pipeline.ContextWithCorrelationID(r.Context(), corr)
		// Tracing middleware in front (tracing.HTTP) already put its server
		// span's traceparent in the context; without it, carry the caller's.
		if tp := r.Header.Get(HeaderTraceParent); tp != "" && pipeline.TraceParentFromContext(ctx) == "" {
			if _, ok := pipeline.TraceIDFromTraceParent(tp); ok {
				ctx = pipeline.ContextWithTraceParent(ctx, tp)
			}
		}

		if msg := checkContentType(r.Header.Get("Content-Type")); msg != "" {
			writeError(w, http.StatusUnsupportedMediaType, APIError{Code: "unsupported_media_type", Message: msg})
			return
		}
		// The whole body first: one over the limit is 413 whatever it holds.
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBytes))
		if err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				writeError(w, http.StatusRequestEntityTooLarge, APIError{Code: "body_too_large", Message: fmt.Sprintf("the body must be at most %d bytes", MaxRequestBytes)})
				return
			}
			writeError(w, http.StatusBadRequest, APIError{Code: "unreadable_body", Message: "the body could not be read"})
			return
		}
		if len(bytes.TrimSpace(body)) == 0 {
			writeError(w, http.StatusBadRequest, APIError{Code: "invalid_json", Message: "the body is empty: send the order as a JSON object"})
			return
		}
		key := r.Header.Get(HeaderIdempotencyKey)
		if key == "" {
			writeError(w, http.StatusBadRequest, APIError{Code: "missing_idempotency_key", Message: "the Idempotency-Key header is required"})
			return
		}
		res, err := call.Call(ctx, ToolCreateOrder, key, body)
		var ie *agenttools.InputError
		switch {
		case errors.As(err, &ie) && ie.Malformed:
			writeError(w, http.StatusBadRequest, APIError{Code: "invalid_json", Message: "the body is not a valid create_order JSON object: " + ie.Error(), Fields: ie.Fields})
		case errors.As(err, &ie):
			writeError(w, http.StatusUnprocessableEntity, APIError{Code: "invalid_input", Message: ie.Error(), Fields: ie.Fields})
		case errors.Is(err, agenttools.ErrInvalidKey):
			writeError(w, http.StatusBadRequest, APIError{Code: "invalid_idempotency_key", Message: err.Error()})
		case errors.Is(err, agenttools.ErrKeyConflict):
			writeError(w, http.StatusUnprocessableEntity, APIError{Code: "idempotency_key_reused", Message: ErrIdempotencyKeyReused.Error()})
		case err != nil:
			logger.Error("create_order failed", "error", err, "correlation_id", corr)
			writeError(w, http.StatusInternalServerError, APIError{Code: "internal", Message: "the order could not be placed; it is safe to retry with the same Idempotency-Key"})
		default:
			var placed OrderPlaced
			if err := json.Unmarshal(res.Output, &placed); err != nil {
				logger.Error("create_order answered what is not an order", "error", err)
				writeError(w, http.StatusInternalServerError, APIError{Code: "internal", Message: "the order's answer could not be read"})
				return
			}
			status := http.StatusCreated
			if res.Replay {
				status = http.StatusOK
			}
			writeJSON(w, status, Result{OrderID: placed.OrderID, Deduped: res.Replay})
		}
	})
	return JSONErrors(mux)
}

// checkContentType accepts application/json with no charset or UTF-8 (the
// only encoding JSON has, RFC 8259); it says what is wrong otherwise.
func checkContentType(ct string) string {
	if ct == "" {
		return "the Content-Type header is required: application/json"
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != "application/json" {
		return "Content-Type must be application/json"
	}
	for k, v := range params {
		if k != "charset" || !strings.EqualFold(v, "utf-8") {
			return "Content-Type must be application/json, with charset utf-8 if any"
		}
	}
	return ""
}

// JSONErrors answers unknown paths (404) and methods (405) in the API's
// JSON error envelope: agenttools.JSONErrors, the same envelope.
func JSONErrors(mux *http.ServeMux) http.Handler { return agenttools.JSONErrors(mux) }

// ParseCreateOrder reads one create_order JSON object from body, strictly
// (see strictjson: unknown or misspelt fields, duplicate keys, invalid
// UTF-8 and trailing data are refused, with errors that name the field),
// into an Input with the idempotency key. It does not validate the values;
// Input.Validate does. Read errors stay wrapped, so a caller can still tell
// an oversize body (*http.MaxBytesError) from a malformed one.
func ParseCreateOrder(body io.Reader, idempotencyKey string) (Input, error) {
	data, err := io.ReadAll(body)
	if err != nil {
		return Input{}, fmt.Errorf("reading the body: %w", err)
	}
	var req createOrderRequest
	if err := strictjson.Decode(data, &req, strictjson.Options{}); err != nil {
		return Input{}, fmt.Errorf("the body is not a valid create_order JSON object: %w", err)
	}
	return Input{UserID: req.UserID, Amount: req.Amount, Currency: req.Currency, IdempotencyKey: idempotencyKey}, nil
}

func writeError(w http.ResponseWriter, status int, e APIError) {
	writeJSON(w, status, map[string]APIError{"error": e})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // the status is sent; a failed write has no one left to tell
}
