package ordersapp_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type hostCase struct {
	method, url, host, origin, token, body string
}

func do(t *testing.T, c hostCase) (int, string) {
	t.Helper()
	req, err := http.NewRequest(c.method, c.url, strings.NewReader(c.body))
	require.NoError(t, err)
	req.Host = c.host
	if c.origin != "" {
		req.Header.Set("Origin", c.origin)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "key-"+pipelinetest.UniqueName(""))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1
// reaches the loopback servers with its own Host. They refuse it (421),
// for the tools, the application's routes and the console alike, and a
// browser's cross-site POST is refused (403) whatever its Host. Nothing is
// written. The allow-list is configurable.
func TestLoopbackServersRefuseRebindingAndForeignOrigins(t *testing.T) {
	t.Parallel()
	cfg, _, _ := testConfig(t)
	logs := &pipelinetest.SyncBuffer{}
	a := newApp(t, cfg, logs)
	stop, err := a.Start(context.Background(), app.Components{HTTP: true})
	require.NoError(t, err)
	defer stop()
	api := "http://" + listenAddr(t, logs.String(), "HTTP API listening")
	admin := "http://" + listenAddr(t, logs.String(), "admin listening")
	order := `{"user_id":"mallory","amount":99999999,"currency":"USD"}`
	for _, c := range []hostCase{
		{method: "POST", url: api + "/tools/create_order", host: "evil.example:80", body: order},
		{method: "POST", url: api + "/orders", host: "evil.example", body: order},
		{method: "POST", url: api + "/mcp", host: "evil.example", body: `{}`},
		{method: "GET", url: admin + "/console/poison", host: "evil.example"},
		{method: "GET", url: admin + "/console/", host: "127.0.0.1.evil.example"},
	} {
		status, body := do(t, c)
		require.Contains(t, []int{http.StatusMisdirectedRequest, http.StatusForbidden}, status, "%s %s Host %s: %s", c.method, c.url, c.host, body)
	}
	for _, c := range []hostCase{
		{method: "POST", url: api + "/tools/create_order", host: "localhost", origin: "http://evil.example", body: order},
		{method: "POST", url: api + "/orders", host: "127.0.0.1", origin: "https://evil.example", body: order},
	} {
		status, body := do(t, c)
		require.Equal(t, http.StatusForbidden, status, "%s %s Origin %s: %s", c.method, c.url, c.origin, body)
	}
	var orders int
	require.NoError(t, a.Pool().QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&orders))
	require.Zero(t, orders, "nothing was placed")

	status, body := do(t, hostCase{method: "POST", url: api + "/orders", host: "localhost:8080", body: order})
	require.Less(t, status, 300, body)
	status, body = do(t, hostCase{method: "GET", url: admin + "/console/", host: "[::1]:9091", token: consoleToken})
	require.Equal(t, http.StatusOK, status, body)
}

// FERRY_HTTP_ALLOWED_HOSTS names the hosts; with FERRY_MCP_TOKEN set, the
// application's routes need the token as /mcp and /tools do.
func TestAllowedHostsAndTheTokenCoverEveryRoute(t *testing.T) {
	t.Parallel()
	cfg, _, _ := testConfig(t)
	lookup := func(v string) func(string) (string, bool) {
		return func(name string) (string, bool) {
			if name == "FERRY_HTTP_ALLOWED_HOSTS" {
				return v, true
			}
			return "", false
		}
	}
	env, err := app.ConfigFromLookup(lookup("shop.example, [::1]"))
	require.NoError(t, err)
	require.Equal(t, []string{"shop.example", "::1"}, env.HTTPServer.AllowedHosts)
	cfg.HTTPServer.AllowedHosts = env.HTTPServer.AllowedHosts
	cfg.MCPToken = "a-token-long-enough-1234"
	logs := &pipelinetest.SyncBuffer{}
	a := newApp(t, cfg, logs)
	stop, err := a.Start(context.Background(), app.Components{HTTP: true})
	require.NoError(t, err)
	defer stop()
	api := "http://" + listenAddr(t, logs.String(), "HTTP API listening")
	order := `{"user_id":"sam","amount":10,"currency":"USD"}`
	status, _ := do(t, hostCase{method: "POST", url: api + "/orders", host: "localhost", token: cfg.MCPToken, body: order})
	require.Equal(t, http.StatusMisdirectedRequest, status, "localhost is not in the list")
	for _, path := range []string{"/orders", "/tools/create_order"} {
		status, _ = do(t, hostCase{method: "POST", url: api + path, host: "shop.example", body: order})
		require.Equal(t, http.StatusUnauthorized, status, path)
	}
	status, body := do(t, hostCase{method: "POST", url: api + "/orders", host: "shop.example", token: cfg.MCPToken, body: order})
	require.Less(t, status, 300, body)
	// A health probe has no token: /healthz answers without it, as the
	// docs say, and only GET.
	status, body = do(t, hostCase{method: "GET", url: api + "/healthz", host: "shop.example"})
	require.Equal(t, http.StatusOK, status, body)
	status, _ = do(t, hostCase{method: "POST", url: api + "/healthz", host: "shop.example", body: "{}"})
	require.Equal(t, http.StatusUnauthorized, status, "only the probe's GET is open")

	_, err = app.ConfigFromLookup(lookup("http://shop.example:8080"))
	require.ErrorContains(t, err, "FERRY_HTTP_ALLOWED_HOSTS")
}

// Where messages wait at the broker: with the relay running and no
// consumer, the route table's queues fill; the metrics and the console
// show each queue with its ready messages and no consumer.
func TestQueuesWithoutConsumersAreShown(t *testing.T) {
	t.Parallel()
	h := start(t, app.Options{}, app.Components{Relay: true})
	ctx := context.Background()
	for i := range 3 {
		_, err := h.orders.CreateOrder(ctx, orders.Input{UserID: "qwait", Amount: 100, Currency: "JPY", IdempotencyKey: "q-" + string(rune('a'+i))})
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		stats, err := h.app.QueueStats(ctx)
		if err != nil {
			return false
		}
		ready := 0
		for _, st := range stats {
			if st.Consumers == 0 {
				ready += st.Ready
			}
		}
		return ready >= 6 // three charges and three mails
	}, 20*time.Second, 50*time.Millisecond)

	require.NoError(t, h.app.Metrics().Refresh(ctx, h.app.Pool()))
	srv := httptest.NewServer(h.app.Metrics().Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Regexp(t, `ferry_queue_messages\{handler="notifications\.mail",queue="[^"]*notifications\.mail"\} 3`, string(body))
	require.Regexp(t, `ferry_queue_consumers\{handler="notifications\.mail",queue="[^"]*notifications\.mail"\} 0`, string(body))

	con, err := h.app.Console()
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/console/", nil)
	req.RemoteAddr = "127.0.0.1:1234"
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	con.ServeHTTP(rec, req)
	require.Equal(t, http.StatusOK, rec.Code)
	require.Contains(t, rec.Body.String(), `id="queues"`)
	require.Contains(t, rec.Body.String(), "no consumer")
}
