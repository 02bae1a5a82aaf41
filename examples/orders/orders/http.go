package orders

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/ferry-dev/ferry/pipeline"
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

// Handler returns the HTTP API: POST /orders with an Idempotency-Key header
// and a JSON body {"user_id", "amount", "currency"}. It answers 201 with
// {"order_id", "deduped": false} for a new order, 200 with "deduped": true
// for a repeated key, and a JSON {"error": {...}} with 400, 413, 415 or 422
// for input it refuses (nothing is written then).
func Handler(svc *Service, logger *slog.Logger) http.Handler {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		corr := r.Header.Get(HeaderCorrelationID)
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

		if ct := r.Header.Get("Content-Type"); ct != "" {
			if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
				writeError(w, http.StatusUnsupportedMediaType, APIError{Code: "unsupported_media_type", Message: "Content-Type must be application/json"})
				return
			}
		}
		key := r.Header.Get(HeaderIdempotencyKey)
		if key == "" {
			writeError(w, http.StatusBadRequest, APIError{Code: "missing_idempotency_key", Message: "the Idempotency-Key header is required"})
			return
		}
		in, err := ParseCreateOrder(http.MaxBytesReader(w, r.Body, MaxRequestBytes), key)
		if err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				writeError(w, http.StatusRequestEntityTooLarge, APIError{Code: "body_too_large", Message: fmt.Sprintf("the body must be at most %d bytes", MaxRequestBytes)})
				return
			}
			writeError(w, http.StatusBadRequest, APIError{Code: "invalid_json", Message: err.Error()})
			return
		}
		res, err := svc.CreateOrder(ctx, in)
		var verr *ValidationError
		switch {
		case errors.As(err, &verr):
			writeError(w, http.StatusUnprocessableEntity, APIError{Code: "invalid_input", Message: verr.Error(), Fields: verr.Fields})
		case errors.Is(err, ErrIdempotencyKeyReused):
			writeError(w, http.StatusUnprocessableEntity, APIError{Code: "idempotency_key_reused", Message: err.Error()})
		case err != nil:
			logger.Error("create_order failed", "error", err, "correlation_id", corr)
			writeError(w, http.StatusInternalServerError, APIError{Code: "internal", Message: "the order could not be placed; it is safe to retry with the same Idempotency-Key"})
		case res.Deduped:
			writeJSON(w, http.StatusOK, res)
		default:
			writeJSON(w, http.StatusCreated, res)
		}
	})
	return mux
}

// ParseCreateOrder reads one create_order JSON object from body (unknown
// fields refused, nothing after it) into an Input with the idempotency key.
// It does not validate the values; Input.Validate does.
func ParseCreateOrder(body io.Reader, idempotencyKey string) (Input, error) {
	var req createOrderRequest
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	// Read errors stay wrapped, so a caller can still tell an oversize body
	// (*http.MaxBytesError) from a malformed one.
	if err := dec.Decode(&req); err != nil {
		return Input{}, fmt.Errorf("the body is not a valid create_order JSON object: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		if err != nil {
			return Input{}, fmt.Errorf("the body must hold one JSON object: %w", err)
		}
		return Input{}, errors.New("the body must hold one JSON object")
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
