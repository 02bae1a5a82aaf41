// Package mcptools serves a agenttools.Runner over the Model Context Protocol
// with the official Go SDK: over stdio (`ferry mcp`) and over streamable
// HTTP (mounted at /mcp on the API server), with optional Bearer-token auth
// and the SDK's DNS-rebinding protection left on.
//
// The idempotency key of a call comes from the request's _meta
// (agenttools.MetaIdempotencyKey), which the host sets; it is not in any input
// schema, so the model cannot invent one. Tool annotations say what each
// tool is: a keyed tool is not read-only, not destructive (it only adds
// intents), idempotent (its key makes it so) and of a closed world (its
// effects leave only through the outbox); intent_status is read-only.
// Results carry structured content and its text, and _meta
// "dev.ferry/replay" when the answer is a stored one.
package mcptools

import (
	"bytes"
	"cmp"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/ferry-dev/ferry/agenttools"
)

// MetaReplay is set (true) in a result's _meta when the answer is the
// stored result of an earlier call with the same key and arguments.
const MetaReplay = "dev.ferry/replay"

// MinTokenLength bounds HTTPOptions.Token.
const MinTokenLength = 16

// NewServer returns an MCP server with r's tools.
func NewServer(r *agenttools.Runner, impl *mcp.Implementation, logger *slog.Logger) *mcp.Server {
	if impl == nil {
		impl = &mcp.Implementation{Name: "ferry", Version: "dev"}
	}
	srv := mcp.NewServer(impl, &mcp.ServerOptions{Logger: logger})
	for _, t := range r.Tools() {
		d := t.Def()
		closed := false
		tool := &mcp.Tool{
			Name: d.Name, Title: d.Title, Description: d.Description,
			InputSchema: t.InputSchema(), OutputSchema: t.OutputSchema(),
			Annotations: &mcp.ToolAnnotations{Title: d.Title, ReadOnlyHint: d.ReadOnly, OpenWorldHint: &closed},
		}
		if !d.ReadOnly {
			tool.Annotations.DestructiveHint = &closed
			tool.Annotations.IdempotentHint = true
		}
		name := d.Name
		srv.AddTool(tool, func(ctx context.Context, req *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
			key, err := metaKey(req.Params.Meta)
			var res *agenttools.Result
			if err == nil {
				res, err = r.Call(ctx, name, key, req.Params.Arguments)
			}
			if err != nil {
				// A tool error, not a protocol error: the model reads it and
				// can correct its arguments (MCP spec, tools/call errors).
				out := &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: message(err)}}}
				var ie *agenttools.InputError
				if errors.As(err, &ie) && len(ie.Fields) > 0 {
					out.StructuredContent = map[string]any{"error": message(err), "fields": ie.Fields}
				}
				return out, nil
			}
			// The stored result byte for byte, a replay or not: the replay is
			// said in _meta, not by changing the text.
			text := string(res.Output)
			return &mcp.CallToolResult{
				Meta:              mcp.Meta{MetaReplay: res.Replay, agenttools.MetaIdempotencyKey: res.Key},
				Content:           []mcp.Content{&mcp.TextContent{Text: text}},
				StructuredContent: json.RawMessage(res.Output),
			}, nil
		})
	}
	return srv
}

// metaKey reads the host's idempotency key from _meta: absent is
// agenttools.ErrMissingKey, present but not a string agenttools.ErrInvalidKey.
func metaKey(meta mcp.Meta) (string, error) {
	v, ok := meta[agenttools.MetaIdempotencyKey]
	if !ok || v == nil {
		return "", nil // the runner says whether this tool needs one
	}
	key, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%w: _meta %q must be a string, got %s", agenttools.ErrInvalidKey, agenttools.MetaIdempotencyKey, jsonKind(v))
	}
	return key, nil
}

func jsonKind(v any) string {
	switch v.(type) {
	case float64, json.Number:
		return "a number"
	case bool:
		return "a boolean"
	case map[string]any:
		return "an object"
	case []any:
		return "an array"
	}
	return fmt.Sprintf("%T", v)
}

// message is what the model is told: the error's own words for what it
// can fix, and no internals for what it cannot.
func message(err error) string {
	var ie *agenttools.InputError
	switch {
	case errors.As(err, &ie), errors.Is(err, agenttools.ErrMissingKey), errors.Is(err, agenttools.ErrInvalidKey),
		errors.Is(err, agenttools.ErrKeyConflict), errors.Is(err, agenttools.ErrUnknownTool):
		return err.Error()
	}
	return "the call failed and wrote nothing; it is safe to call again with the same idempotency key"
}

// ServeStdio serves r's tools over stdin and stdout until ctx ends or the
// client disconnects.
func ServeStdio(ctx context.Context, r *agenttools.Runner, impl *mcp.Implementation, logger *slog.Logger) error {
	return NewServer(r, impl, logger).Run(ctx, &mcp.StdioTransport{})
}

// Defaults of HTTPOptions.
const (
	DefaultSessionTimeout = 30 * time.Minute
	DefaultMaxSessions    = 1000
	// hardBodyLimit is the SDK's own bound, behind limits' (which never
	// lets it see more than MaxRequestBytes).
	hardBodyLimit = 8 << 20
	// idScanBytes is how much of a refused request is read to find its
	// JSON-RPC id.
	idScanBytes = 4 << 10
)

// HTTPOptions configure HTTPHandler.
type HTTPOptions struct {
	// Token, if set, is the Bearer token every request needs (at least 16
	// characters). Default: none (keep the API server on loopback then).
	Token string
	// SessionTimeout closes a session that has had no request for this
	// long, releasing what it holds. Default 30m.
	SessionTimeout time.Duration
	// MaxSessions caps the sessions open at once: a new one beyond it is
	// refused (a JSON-RPC error) until others close or time out.
	// Default 1000.
	MaxSessions int
	// Implementation names the server to clients.
	Implementation *mcp.Implementation
	Logger         *slog.Logger
}

// HTTPHandler serves r's tools over MCP's streamable HTTP transport. The
// SDK's DNS-rebinding protection stays on: a request that arrives on a
// loopback address with a non-loopback Host is refused.
func HTTPHandler(r *agenttools.Runner, o HTTPOptions) (http.Handler, error) {
	if o.Token != "" && len(o.Token) < MinTokenLength {
		return nil, errors.New("mcptools: the token must be at least 16 characters")
	}
	if o.SessionTimeout < 0 || o.MaxSessions < 0 {
		return nil, errors.New("mcptools: the session timeout and cap must not be negative")
	}
	o.SessionTimeout = cmp.Or(o.SessionTimeout, DefaultSessionTimeout)
	o.MaxSessions = cmp.Or(o.MaxSessions, DefaultMaxSessions)
	srv := NewServer(r, o.Implementation, o.Logger)
	// The SDK answers an oversized request with a bare HTTP 413, outside
	// JSON-RPC, and its client then drops the session; limits lets it see
	// only requests within the limit and answers the others itself.
	var h http.Handler = limits(srv, o, mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv },
		&mcp.StreamableHTTPOptions{Logger: o.Logger, MaxRequestBodyBytes: hardBodyLimit, SessionTimeout: o.SessionTimeout}))
	if o.Token != "" {
		token := []byte(o.Token)
		verify := func(_ context.Context, got string, _ *http.Request) (*auth.TokenInfo, error) {
			if subtle.ConstantTimeCompare([]byte(got), token) != 1 {
				return nil, auth.ErrInvalidToken
			}
			return &auth.TokenInfo{Expiration: time.Now().Add(time.Hour)}, nil
		}
		h = auth.RequireBearerToken(verify, nil)(h)
	}
	return h, nil
}

// MaxRequestBytes is the largest JSON-RPC request /mcp takes: a tool's
// arguments (agenttools.MaxArgumentsBytes) and the envelope around them.
const MaxRequestBytes = agenttools.MaxArgumentsBytes + 16<<10

// limits answers, as JSON-RPC errors a client's session survives, what
// the SDK would refuse at the HTTP level: a request over MaxRequestBytes,
// and a new session beyond MaxSessions. Written by hand: the SDK has no
// session cap, and its size limit answers outside JSON-RPC.
func limits(srv *mcp.Server, o HTTPOptions, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		// Never more than the limit in memory: a request that announces
		// more is refused before its body is read, one that sends more is
		// cut one byte past the limit.
		tooLarge := func(body []byte, size string) {
			writeRPCError(w, http.StatusOK, body, -32602, fmt.Sprintf("the request is %s bytes, more than the %d this server takes (a tool's arguments: at most %d); nothing was done",
				size, MaxRequestBytes, agenttools.MaxArgumentsBytes))
		}
		if r.ContentLength > MaxRequestBytes {
			head, _ := io.ReadAll(io.LimitReader(r.Body, idScanBytes)) // the id, to answer under it
			tooLarge(head, strconv.FormatInt(r.ContentLength, 10))
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, MaxRequestBytes+1))
		if err != nil {
			http.Error(w, "the request body could not be read", http.StatusBadRequest)
			return
		}
		if len(body) > MaxRequestBytes {
			tooLarge(body, "more than "+strconv.Itoa(MaxRequestBytes))
			return
		}
		if r.Header.Get("Mcp-Session-Id") == "" {
			open := 0
			for range srv.Sessions() {
				open++
			}
			if open >= o.MaxSessions {
				w.Header().Set("Retry-After", "60")
				writeRPCError(w, http.StatusOK, body, -32000, fmt.Sprintf("too many open sessions (%d): try again later", open))
				return
			}
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
	})
}

var idPrefix = regexp.MustCompile(`"id"\s*:\s*(-?[0-9]+|"(?:[^"\\]|\\.)*")`)

// writeRPCError answers the request in body with a JSON-RPC error, under
// the request's own id so the client can match it.
func writeRPCError(w http.ResponseWriter, status int, body []byte, code int, msg string) {
	var req struct {
		ID json.RawMessage `json:"id"`
	}
	if json.Unmarshal(body, &req) != nil {
		// A request cut short: its id, if it came early, as clients send it.
		if m := idPrefix.FindSubmatch(body[:min(len(body), idScanBytes)]); m != nil {
			req.ID = m[1]
		}
	}
	id := req.ID
	if len(id) == 0 {
		id = json.RawMessage("null")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"jsonrpc": "2.0", "id": id, "error": map[string]any{"code": code, "message": msg}})
}
