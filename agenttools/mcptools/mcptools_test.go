package mcptools_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/agenttools/mcptools"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type echoArgs struct {
	Text string `json:"text" jsonschema:"what to echo"`
}

func (echoArgs) Validate() error { return nil }

type echoed struct {
	Text string `json:"text"`
}

func serve(t *testing.T, o mcptools.HTTPOptions) string {
	t.Helper()
	pool := pipelinetest.Postgres(t)
	echo, err := agenttools.New(agenttools.Def{Name: "echo", Description: "echoes a text"},
		func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, in echoArgs) (echoed, error) {
			_, err := emit.Emit(ctx, "echo.made", "echo", map[string]any{"text": in.Text})
			return echoed{Text: in.Text}, err
		})
	require.NoError(t, err)
	r, err := agenttools.NewRunner(pool, pipelinetest.Outbox(t), []agenttools.Tool{echo}, nil)
	require.NoError(t, err)
	h, err := mcptools.HTTPHandler(r, o)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

func connect(ctx context.Context, url string) (*mcp.ClientSession, error) {
	return mcp.NewClient(&mcp.Implementation{Name: "test", Version: "1"}, nil).
		Connect(ctx, &mcp.StreamableClientTransport{Endpoint: url, MaxRetries: -1}, nil)
}

func text(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// An oversized request is answered as a JSON-RPC error under its own id,
// and the session goes on; a _meta key that is not a string is an invalid
// key, not a missing one; a replay's text is the stored result byte for
// byte (the replay is said in _meta).
func TestMCPOverHTTPEdges(t *testing.T) {
	t.Parallel()
	url := serve(t, mcptools.HTTPOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := connect(ctx, url)
	require.NoError(t, err)
	defer s.Close()

	_, err = s.CallTool(ctx, &mcp.CallToolParams{Name: "echo", Meta: mcp.Meta{agenttools.MetaIdempotencyKey: "k-big"},
		Arguments: map[string]any{"text": strings.Repeat("x", mcptools.MaxRequestBytes)}})
	require.Error(t, err)
	require.Contains(t, err.Error(), "more than")

	first, err := s.CallTool(ctx, &mcp.CallToolParams{Name: "echo", Meta: mcp.Meta{agenttools.MetaIdempotencyKey: "k-1"}, Arguments: map[string]any{"text": "hi"}})
	require.NoError(t, err, "the session survived the oversized request")
	require.False(t, first.IsError, text(first))
	again, err := s.CallTool(ctx, &mcp.CallToolParams{Name: "echo", Meta: mcp.Meta{agenttools.MetaIdempotencyKey: "k-1"}, Arguments: map[string]any{"text": "hi"}})
	require.NoError(t, err)
	require.Equal(t, true, again.Meta[mcptools.MetaReplay])
	require.Equal(t, text(first), text(again), "a replay's text is the stored result byte for byte")

	for _, bad := range []any{42, true, map[string]any{"k": "v"}} {
		res, err := s.CallTool(ctx, &mcp.CallToolParams{Name: "echo", Meta: mcp.Meta{agenttools.MetaIdempotencyKey: bad}, Arguments: map[string]any{"text": "hi"}})
		require.NoError(t, err)
		require.True(t, res.IsError)
		require.Contains(t, text(res), "must be a string")
		require.NotContains(t, text(res), "needs an idempotency key")
	}
}

// /mcp never holds more than its limit of a request in memory: one that
// announces a larger body is answered before the body arrives (the
// client here sends only its first 4 KiB of the 8 MiB it announced), under
// its own JSON-RPC id; one without a length is cut one byte past the limit.
func TestMCPRefusesOversizedRequestsBeforeReadingThem(t *testing.T) {
	t.Parallel()
	url := serve(t, mcptools.HTTPOptions{})
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	require.NoError(t, err)
	defer conn.Close()
	head := `{"jsonrpc":"2.0","id":77,"method":"tools/call","params":{"name":"echo","arguments":{"text":"` + strings.Repeat("x", 4<<10)
	_, err = fmt.Fprintf(conn, "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: %d\r\n\r\n%s", 8<<20, head)
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err, "answered without waiting for the 8 MiB announced")
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	require.Contains(t, string(body), `"id":77`)
	require.Contains(t, string(body), "more than")

	// No length: read up to the limit, no further.
	big := `{"jsonrpc":"2.0","id":78,"method":"tools/call","params":{"name":"echo","arguments":{"text":"` + strings.Repeat("x", 2*mcptools.MaxRequestBytes) + `"}}}`
	req, err := http.NewRequest(http.MethodPost, url+"/mcp", io.MultiReader(strings.NewReader(big))) // chunked: no Content-Length
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	require.Contains(t, string(b), `"id":78`)
	require.Contains(t, string(b), "more than")
}

// Sessions are capped, and an idle one is closed after the timeout, which
// makes room for new ones. Raw initialize requests, one POST per session:
// the SDK's client may send an initialize twice on a busy machine, which
// would count a session the test did not mean to open.
func TestMCPSessionsAreCappedAndExpire(t *testing.T) {
	t.Parallel()
	url := serve(t, mcptools.HTTPOptions{MaxSessions: 2, SessionTimeout: 300 * time.Millisecond})
	initialize := func() (session, body string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"initialize",
			"params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"test","version":"1"}}}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.Header.Get("Mcp-Session-Id"), string(b)
	}
	for range 2 {
		id, body := initialize()
		require.NotEmpty(t, id, body)
	}
	id, body := initialize()
	require.Empty(t, id, "a third session is refused")
	require.Contains(t, body, "too many open sessions")
	require.Eventually(t, func() bool {
		id, _ := initialize()
		return id != ""
	}, 10*time.Second, 100*time.Millisecond, "idle sessions close and make room")
}
