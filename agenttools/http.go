package agenttools

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strings"

	"github.com/ferry-dev/ferry/pipeline"
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
// 400 (missing_idempotency_key, invalid_idempotency_key, invalid_json: an
// empty body too), 404 (unknown_tool, or not_found for a path that is no
// endpoint), 405 (method_not_allowed), 409 (idempotency_key_conflict), 413,
// 415 (a Content-Type other than application/json, or none), 422
// (invalid_input, with fields; invalid_event when the tool's intent is one
// the outbox refuses) or 500.
func HTTPHandler(r *Runner, logger *slog.Logger) http.Handler {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /tools", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"tools": r.Describe()})
	})
	mux.HandleFunc("POST /tools/{name}", func(w http.ResponseWriter, req *http.Request) {
		mt, params, err := mime.ParseMediaType(req.Header.Get("Content-Type"))
		if err != nil || mt != "application/json" || (params["charset"] != "" && !strings.EqualFold(params["charset"], "utf-8")) {
			writeError(w, http.StatusUnsupportedMediaType, HTTPError{Code: "unsupported_media_type", Message: "Content-Type must be application/json"})
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, req.Body, MaxArgumentsBytes))
		if err != nil {
			writeError(w, http.StatusRequestEntityTooLarge, HTTPError{Code: "body_too_large", Message: fmt.Sprintf("the arguments must be at most %d bytes", MaxArgumentsBytes)})
			return
		}
		if len(bytes.TrimSpace(body)) == 0 {
			writeError(w, http.StatusBadRequest, HTTPError{Code: "invalid_json", Message: "the body is empty: send the arguments as a JSON object ({} for none)"})
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
	return JSONErrors(mux)
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
	case errors.Is(err, pipeline.ErrInvalidEvent):
		// Input that made an intent the outbox refuses (a header that is
		// not text, say): trying again cannot help, so it is not a 500.
		return http.StatusUnprocessableEntity, HTTPError{Code: "invalid_event", Message: pipeline.CleanText(err.Error(), 500)}
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

// JSONErrors answers the requests mux has no route for (404) or no method
// for (405, with its Allow header) in the API's JSON error envelope rather
// than ServeMux's plain text; every other request is mux's. HTTPHandler
// uses it, and so can an application's own API.
func JSONErrors(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		// No pattern: ServeMux's own 404/405/redirect handler. Run it
		// against a recorder to learn which, then answer in JSON.
		rec := &statusRecorder{header: http.Header{}}
		h.ServeHTTP(rec, r)
		switch rec.status {
		case http.StatusMethodNotAllowed:
			w.Header().Set("Allow", rec.header.Get("Allow"))
			writeError(w, http.StatusMethodNotAllowed, HTTPError{Code: "method_not_allowed", Message: r.Method + " is not allowed here; allowed: " + rec.header.Get("Allow")})
		case http.StatusNotFound:
			writeError(w, http.StatusNotFound, HTTPError{Code: "not_found", Message: "no such endpoint"})
		default: // a redirect (a cleaned path): pass it on as it is
			for k, v := range rec.header {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.status)
		}
	})
}

type statusRecorder struct {
	header http.Header
	status int
}

func (s *statusRecorder) Header() http.Header { return s.header }
func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return len(b), nil
}
func (s *statusRecorder) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
}
