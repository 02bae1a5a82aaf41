package ordersapp_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/agenttools/mcptools"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The MCP maintainers' own Go client against Ferry's tools, over stdio
// (`ferry mcp`, a subprocess) and over streamable HTTP (/mcp on the API
// server), with the relay and consumers running: the key in _meta makes a
// repeated create_order one order, one charge and one mail.
func TestMCPToolsWithTheSDKClient(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.MCPToken = "mcp-test-token-0123456789"
	h := startWith(t, cfg, provider, sink, app.Options{}, app.Components{Relay: true, Consumers: true})
	api, err := h.app.APIHandler()
	require.NoError(t, err)
	srv := httptest.NewServer(api)
	defer srv.Close()

	bin := filepath.Join(t.TempDir(), "ferry")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/ferry-dev/ferry/cmd/ferry").CombinedOutput()
	require.NoError(t, err, "building ferry: %s", out)
	cmd := exec.Command(bin, "mcp")
	cmd.Env = append(os.Environ(), "FERRY_DATABASE_URL="+cfg.DatabaseURL, "FERRY_DATABASE_SCHEMA="+cfg.DatabaseSchema, "FERRY_LOG_LEVEL=warn")
	var stderr pipelinetest.SyncBuffer
	cmd.Stderr = &stderr

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	client := mcp.NewClient(&mcp.Implementation{Name: "ferry-test", Version: "1"}, nil)
	stdio, err := client.Connect(ctx, &mcp.CommandTransport{Command: cmd}, nil)
	require.NoError(t, err, "ferry mcp: %s", stderr.String())
	defer stdio.Close()

	// Without the token, the HTTP endpoint refuses.
	_, err = mcp.NewClient(&mcp.Implementation{Name: "anon"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: srv.URL + "/mcp", MaxRetries: -1}, nil)
	require.Error(t, err, "no token, no session")
	withToken := &http.Client{Transport: bearer{token: cfg.MCPToken}}
	remote, err := client.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: srv.URL + "/mcp", HTTPClient: withToken}, nil)
	require.NoError(t, err)
	defer remote.Close()

	for name, session := range map[string]*mcp.ClientSession{"stdio": stdio, "http": remote} {
		listed, err := session.ListTools(ctx, nil)
		require.NoError(t, err, name)
		byName := map[string]*mcp.Tool{}
		for _, tl := range listed.Tools {
			byName[tl.Name] = tl
		}
		require.Contains(t, byName, orders.ToolCreateOrder, name)
		require.Contains(t, byName, orders.ToolSendReminder, name)
		require.Contains(t, byName, agenttools.IntentStatusName, name)
		create := byName[orders.ToolCreateOrder]
		schema, _ := json.Marshal(create.InputSchema)
		require.Contains(t, string(schema), `"user_id"`)
		require.NotContains(t, strings.ToLower(string(schema)), "idempotency", "%s: the key is the host's, not an argument", name)
		require.NotNil(t, create.OutputSchema)
		a := create.Annotations
		require.False(t, a.ReadOnlyHint)
		require.True(t, a.IdempotentHint)
		require.NotNil(t, a.DestructiveHint)
		require.False(t, *a.DestructiveHint)
		require.NotNil(t, a.OpenWorldHint)
		require.False(t, *a.OpenWorldHint)
		require.True(t, byName[agenttools.IntentStatusName].Annotations.ReadOnlyHint)
	}

	call := func(s *mcp.ClientSession, key string, args map[string]any) *mcp.CallToolResult {
		t.Helper()
		p := &mcp.CallToolParams{Name: orders.ToolCreateOrder, Arguments: args}
		if key != "" {
			p.Meta = mcp.Meta{agenttools.MetaIdempotencyKey: key}
		}
		res, err := s.CallTool(ctx, p)
		require.NoError(t, err)
		return res
	}
	args := map[string]any{"user_id": "agent-7", "amount": 4200, "currency": "JPY"}
	first := call(stdio, "host-key-1", args)
	require.False(t, first.IsError, "%v", first.Content)
	second := call(stdio, "host-key-1", args)
	require.False(t, second.IsError)
	require.JSONEq(t, string(mustJSON(t, first.StructuredContent)), string(mustJSON(t, second.StructuredContent)), "the same answer")
	require.Equal(t, false, first.Meta[mcptools.MetaReplay])
	require.Equal(t, true, second.Meta[mcptools.MetaReplay], "marked as a replay")
	// The same key over the other transport is the same call.
	third := call(remote, "host-key-1", args)
	require.Equal(t, true, third.Meta[mcptools.MetaReplay])

	conflict := call(stdio, "host-key-1", map[string]any{"user_id": "agent-7", "amount": 9999, "currency": "JPY"})
	require.True(t, conflict.IsError)
	require.Contains(t, text(conflict), "other arguments")
	noKey := call(stdio, "", args)
	require.True(t, noKey.IsError)
	require.Contains(t, text(noKey), "idempotency key")
	bad := call(stdio, "host-key-2", map[string]any{"user_id": "a b", "amount": -1, "currency": "EUR"})
	require.True(t, bad.IsError)
	for _, f := range []string{"user_id", "amount", "currency"} {
		require.Contains(t, text(bad), f)
	}

	// 20 concurrent calls with one key over HTTP: one order, one answer.
	var wg sync.WaitGroup
	answers := make([]string, 20)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := remote.CallTool(ctx, &mcp.CallToolParams{Name: orders.ToolCreateOrder, Meta: mcp.Meta{agenttools.MetaIdempotencyKey: "host-key-20"},
				Arguments: map[string]any{"user_id": "agent-20", "amount": 100, "currency": "USD"}})
			if err == nil && !res.IsError {
				answers[i] = string(mustJSON(t, res.StructuredContent))
			} else if err == nil {
				answers[i] = "error: " + text(res)
			}
		}()
	}
	wg.Wait()
	for _, a := range answers {
		require.Equal(t, answers[0], a)
	}
	var n int
	require.NoError(t, h.app.Pool().QueryRow(ctx, `SELECT count(*) FROM orders WHERE user_id = 'agent-20'`).Scan(&n))
	require.Equal(t, 1, n, "twenty concurrent calls with one key, one order")
	require.NoError(t, h.app.Pool().QueryRow(ctx, `SELECT count(*) FROM orders WHERE user_id = 'agent-7'`).Scan(&n))
	require.Equal(t, 1, n)

	// One charge and one mail per order, at the sandbox provider and sink;
	// intent_status tells the agent so.
	eventually(t, "the charges and mails", func() bool { return len(provider.Charges()) == 2 && len(sink.Mails()) == 2 })
	var placed orders.OrderPlaced
	require.NoError(t, json.Unmarshal(mustJSON(t, first.StructuredContent), &placed))
	var status agenttools.StatusOutput
	eventually(t, "intent_status says handled", func() bool {
		res, err := stdio.CallTool(ctx, &mcp.CallToolParams{Name: agenttools.IntentStatusName, Arguments: map[string]any{"tool": orders.ToolCreateOrder, "idempotency_key": "host-key-1"}})
		require.NoError(t, err)
		require.False(t, res.IsError, text(res))
		require.NoError(t, json.Unmarshal(mustJSON(t, res.StructuredContent), &status))
		return len(status.Intents) == 2 && status.Intents[0].State == agenttools.StateHandled && status.Intents[1].State == agenttools.StateHandled
	})
	handlers := map[string]bool{}
	for _, in := range status.Intents {
		require.Equal(t, strconv.FormatInt(placed.OrderID, 10), in.AggregateID)
		for _, hb := range in.HandledBy {
			handlers[hb.Handler] = true
		}
	}
	require.True(t, handlers["payments.charge"] && handlers["notifications.mail"], "%v", handlers)
	time.Sleep(200 * time.Millisecond)
	require.Len(t, provider.Charges(), 2, "no second charge")
	require.Len(t, sink.Mails(), 2, "no second mail")
}

// bearer adds the token, as a host configured with one would.
type bearer struct{ token string }

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
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
