// Package mcptools serves a tools.Runner over the Model Context Protocol
// with the official Go SDK: over stdio (`ferry mcp`) and over streamable
// HTTP (mounted at /mcp on the API server), with optional Bearer-token auth
// and the SDK's DNS-rebinding protection left on.
//
// The idempotency key of a call comes from the request's _meta
// (tools.MetaIdempotencyKey), which the host sets; it is not in any input
// schema, so the model cannot invent one. Tool annotations say what each
// tool is: a keyed tool is not read-only, not destructive (it only adds
// intents), idempotent (its key makes it so) and of a closed world (its
// effects leave only through the outbox); intent_status is read-only.
// Results carry structured content and its text, and _meta
// "dev.ferry/replay" when the answer is a stored one.
package mcptools

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/ferry-dev/ferry/tools"
)

// MetaReplay is set (true) in a result's _meta when the answer is the
// stored result of an earlier call with the same key and arguments.
const MetaReplay = "dev.ferry/replay"

// MinTokenLength bounds HTTPOptions.Token.
const MinTokenLength = 16

// NewServer returns an MCP server with r's tools.
func NewServer(r *tools.Runner, impl *mcp.Implementation, logger *slog.Logger) *mcp.Server {
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
			key, _ := req.Params.Meta[tools.MetaIdempotencyKey].(string)
			res, err := r.Call(ctx, name, key, req.Params.Arguments)
			if err != nil {
				// A tool error, not a protocol error: the model reads it and
				// can correct its arguments (MCP spec, tools/call errors).
				out := &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: message(err)}}}
				var ie *tools.InputError
				if errors.As(err, &ie) && len(ie.Fields) > 0 {
					out.StructuredContent = map[string]any{"error": message(err), "fields": ie.Fields}
				}
				return out, nil
			}
			text := string(res.Output)
			if res.Replay {
				text = "replay of an earlier call with this idempotency key (nothing new was done): " + text
			}
			return &mcp.CallToolResult{
				Meta:              mcp.Meta{MetaReplay: res.Replay, tools.MetaIdempotencyKey: res.Key},
				Content:           []mcp.Content{&mcp.TextContent{Text: text}},
				StructuredContent: json.RawMessage(res.Output),
			}, nil
		})
	}
	return srv
}

// message is what the model is told: the error's own words for what it
// can fix, and no internals for what it cannot.
func message(err error) string {
	var ie *tools.InputError
	switch {
	case errors.As(err, &ie), errors.Is(err, tools.ErrMissingKey), errors.Is(err, tools.ErrInvalidKey),
		errors.Is(err, tools.ErrKeyConflict), errors.Is(err, tools.ErrUnknownTool):
		return err.Error()
	}
	return "the call failed and wrote nothing; it is safe to call again with the same idempotency key"
}

// ServeStdio serves r's tools over stdin and stdout until ctx ends or the
// client disconnects.
func ServeStdio(ctx context.Context, r *tools.Runner, impl *mcp.Implementation, logger *slog.Logger) error {
	return NewServer(r, impl, logger).Run(ctx, &mcp.StdioTransport{})
}

// HTTPOptions configure HTTPHandler.
type HTTPOptions struct {
	// Token, if set, is the Bearer token every request needs (at least 16
	// characters). Default: none (keep the API server on loopback then).
	Token string
	// Implementation names the server to clients.
	Implementation *mcp.Implementation
	Logger         *slog.Logger
}

// HTTPHandler serves r's tools over MCP's streamable HTTP transport. The
// SDK's DNS-rebinding protection stays on: a request that arrives on a
// loopback address with a non-loopback Host is refused.
func HTTPHandler(r *tools.Runner, o HTTPOptions) (http.Handler, error) {
	if o.Token != "" && len(o.Token) < MinTokenLength {
		return nil, errors.New("mcptools: the token must be at least 16 characters")
	}
	srv := NewServer(r, o.Implementation, o.Logger)
	var h http.Handler = mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv },
		&mcp.StreamableHTTPOptions{Logger: o.Logger, MaxRequestBodyBytes: tools.MaxArgumentsBytes + 16<<10})
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
