package tools

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strings"
)

// MaxArgumentsBytes bounds a call's arguments over HTTP.
const MaxArgumentsBytes = 64 << 10

// HTTPError is the JSON error body of HTTPHandler.
type HTTPError struct {
	Code    string            `json:"code"`
	Message string            `json:"message"`
	Fields  map[string]string `json:"fields,omitempty"`
}

// HTTPHandler serves r's tools as plain JSON, for hosts that do not speak
// MCP:
//
//	GET  /tools          the catalogue: names, descriptions, input and output schemas
//	POST /tools/{name}   call a tool; the body is its arguments, the key is
//	                     the Idempotency-Key header (never a body field)
//
// A call answers 200 {"tool", "idempotency_key", "replay", "result",
// "intent_ids"}; errors are {"error": {"code", "message", "fields"}} with
// 400 (missing_idempotency_key, invalid_idempotency_key, invalid_json), 404
// (unknown_tool), 409 (idempotency_key_conflict), 413, 415, 422
// (invalid_input, with fields) or 500.
func HTTPHandler(r *Runner, logger *slog.Logger) http.Handler {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /tools", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"tools": r.Describe()})
	})
	mux.HandleFunc("POST /tools/{name}", func(w http.ResponseWriter, req *http.Request) {
		if ct := req.Header.Get("Content-Type"); ct != "" {
			if mt, params, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" || (params["charset"] != "" && !strings.EqualFold(params["charset"], "utf-8")) {
				writeError(w, http.StatusUnsupportedMediaType, HTTPError{Code: "unsupported_media_type", Message: "Content-Type must be application/json"})
				return
			}
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, req.Body, MaxArgumentsBytes))
		if err != nil {
			writeError(w, http.StatusRequestEntityTooLarge, HTTPError{Code: "body_too_large", Message: fmt.Sprintf("the arguments must be at most %d bytes", MaxArgumentsBytes)})
			return
		}
		res, err := r.Call(req.Context(), req.PathValue("name"), req.Header.Get("Idempotency-Key"), body)
		if err != nil {
			status, e := ErrorStatus(err)
			if status == http.StatusInternalServerError {
				logger.ErrorContext(req.Context(), "tool call failed", "tool", req.PathValue("name"), "error", err)
			}
			writeError(w, status, e)
			return
		}
		writeJSON(w, http.StatusOK, res)
	})
	return mux
}

// ErrorStatus maps a Call error to an HTTP status and error body.
func ErrorStatus(err error) (int, HTTPError) {
	var ie *InputError
	switch {
	case errors.As(err, &ie):
		if ie.Malformed {
			return http.StatusBadRequest, HTTPError{Code: "invalid_json", Message: ie.Error(), Fields: ie.Fields}
		}
		return http.StatusUnprocessableEntity, HTTPError{Code: "invalid_input", Message: ie.Error(), Fields: ie.Fields}
	case errors.Is(err, ErrUnknownTool):
		return http.StatusNotFound, HTTPError{Code: "unknown_tool", Message: err.Error()}
	case errors.Is(err, ErrMissingKey):
		return http.StatusBadRequest, HTTPError{Code: "missing_idempotency_key", Message: "the Idempotency-Key header is required: " + err.Error()}
	case errors.Is(err, ErrInvalidKey):
		return http.StatusBadRequest, HTTPError{Code: "invalid_idempotency_key", Message: err.Error()}
	case errors.Is(err, ErrKeyConflict):
		return http.StatusConflict, HTTPError{Code: "idempotency_key_conflict", Message: err.Error()}
	}
	return http.StatusInternalServerError, HTTPError{Code: "internal", Message: "the call failed and wrote nothing; it is safe to retry with the same Idempotency-Key"}
}

func writeError(w http.ResponseWriter, status int, e HTTPError) {
	writeJSON(w, status, map[string]HTTPError{"error": e})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // the status is sent; nobody is left to tell
}
