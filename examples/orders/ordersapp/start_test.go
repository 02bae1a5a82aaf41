package ordersapp_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	exmigrations "github.com/ferry-dev/ferry/examples/orders/migrations"
	"github.com/ferry-dev/ferry/examples/orders/ordersapp"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func newApp(t *testing.T, cfg app.Config, logs *pipelinetest.SyncBuffer) *app.App {
	t.Helper()
	_, ex, _, _ := testConfigs(t)
	a, err := app.New(context.Background(), cfg, app.Options{
		Routes: ordersapp.Routes(ex), HTTP: ordersapp.HTTP, Tools: ordersapp.Tools, Migrations: []migrations.Set{exmigrations.Set},
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	require.NoError(t, err)
	pipelinetest.TeardownTopology(t, a.Topology())
	t.Cleanup(func() { a.Close() })
	return a
}

// A start that fails (the admin port is taken) leaves no heartbeat row for
// `ferry status` to call DEAD forever, and no goroutine that trips over the
// pool being closed.
func TestFailedStartLeavesNothingBehind(t *testing.T) {
	t.Parallel()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()
	cfg, _, _ := testConfig(t)
	cfg.AdminAddr = taken.Addr().String()
	logs := &pipelinetest.SyncBuffer{}
	a := newApp(t, cfg, logs)

	err = a.Run(context.Background(), app.All, nil)
	require.ErrorContains(t, err, "admin: listening on "+taken.Addr().String())
	instances, err := pgstatus.Instances(context.Background(), a.Pool())
	require.NoError(t, err)
	require.Empty(t, instances, "no heartbeat row for a process that never ran")
	a.Close()
	time.Sleep(100 * time.Millisecond)
	require.NotContains(t, logs.String(), "closed pool")
	require.NotContains(t, logs.String(), "level=WARN")
	require.NotContains(t, logs.String(), "level=ERROR")
}

// The HTTP servers drop a client that sends its body too slowly or sits
// idle on a keep-alive connection, cap their headers, and say when they
// listen beyond loopback; the consumers say when they have started.
func TestHTTPServersBoundSlowAndIdleClients(t *testing.T) {
	t.Parallel()
	cfg, _, _ := testConfig(t)
	cfg.HTTPServer = app.HTTPServerConfig{ReadTimeout: 300 * time.Millisecond, IdleTimeout: 300 * time.Millisecond, MaxHeaderBytes: 4096, MaxConns: 2}
	cfg.AdminAddr = "0.0.0.0:0"
	logs := &pipelinetest.SyncBuffer{}
	a := newApp(t, cfg, logs)
	stop, err := a.Start(context.Background(), app.All)
	require.NoError(t, err)
	defer stop()
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "consumers started") }, 10*time.Second, 20*time.Millisecond)
	require.Contains(t, logs.String(), "the admin server listens beyond loopback")
	addr := listenAddr(t, logs.String(), "HTTP API listening")

	// A body that trickles in is cut off after ReadTimeout.
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.Write([]byte("POST /orders HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nIdempotency-Key: slow\r\nContent-Length: 1000\r\n\r\n{"))
	require.NoError(t, err)
	start := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _ = bufio.NewReader(conn).ReadString('\n') // an error answer or EOF, either way soon
	buf := make([]byte, 1)
	for {
		if _, err := conn.Read(buf); err != nil {
			break
		}
	}
	require.Less(t, time.Since(start), 3*time.Second, "the slow body was cut off")

	// An idle keep-alive connection is closed after IdleTimeout.
	idle, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer idle.Close()
	_, err = idle.Write([]byte("GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"))
	require.NoError(t, err)
	r := bufio.NewReader(idle)
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	resp.Body.Close()
	start = time.Now()
	_ = idle.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = r.ReadByte()
	require.Error(t, err, "the server closed the idle connection")
	require.Less(t, time.Since(start), 3*time.Second)

	// Headers over MaxHeaderBytes are refused.
	req, _ := http.NewRequest("GET", "http://"+addr+"/healthz", nil)
	req.Header.Set("X-Big", strings.Repeat("a", 8192))
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, resp.StatusCode)

	// The served API answers unknown paths and methods in its JSON envelope.
	for path, status := range map[string]int{"/orders": http.StatusMethodNotAllowed, "/nope": http.StatusNotFound} {
		resp, err := http.Get("http://" + addr + path)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, status, resp.StatusCode, path)
		require.Equal(t, "application/json", resp.Header.Get("Content-Type"), path)
		require.Contains(t, string(body), `"error"`)
	}
}

// Slow clients cannot hold the servers' slots: with connections held to
// the admin server and the API sending half a header, and requests
// announcing a body and sending nothing, more than the servers' bounds
// allow (all from one address, as a loopback test must), /readyz and a
// real order are still answered at once; the silent bodies are cut after
// the header timeout's grace, not at ReadTimeout.
func TestSlowClientsCannotHoldTheServers(t *testing.T) {
	t.Parallel()
	cfg, _, _ := testConfig(t)
	cfg.AdminAddr = "127.0.0.1:0"
	cfg.HTTPServer = app.HTTPServerConfig{MaxConns: 40, MaxConnsPerClient: 30, ReadHeaderTimeout: 2 * time.Second}
	logs := &pipelinetest.SyncBuffer{}
	a := newApp(t, cfg, logs)
	stop, err := a.Start(context.Background(), app.All)
	require.NoError(t, err)
	defer stop()
	api := listenAddr(t, logs.String(), "HTTP API listening")
	admin := listenAddr(t, logs.String(), "admin listening")

	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	hold := func(addr, text string, n int) {
		for range n {
			c, err := net.Dial("tcp", addr)
			require.NoError(t, err)
			_, err = c.Write([]byte(text))
			require.NoError(t, err)
			held = append(held, c)
		}
	}
	hold(admin, "GET /readyz HTTP/1.1\r\nHost: local", 60)
	hold(api, "GET /healthz HTTP/1.1\r\nHost: local", 60)
	silent := len(held)
	hold(api, "POST /orders HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nIdempotency-Key: silent\r\nContent-Length: 100000\r\n\r\n", 30)
	time.Sleep(200 * time.Millisecond)

	client := &http.Client{Timeout: 3 * time.Second}
	start := time.Now()
	resp, err := client.Get("http://" + admin + "/readyz")
	require.NoError(t, err, "the admin server answers past the slow clients")
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	req, err := http.NewRequest(http.MethodPost, "http://"+api+"/orders", strings.NewReader(`{"user_id":"alice","amount":1200,"currency":"JPY"}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "slow-clients-real")
	resp, err = client.Do(req)
	require.NoError(t, err, "the API answers past the slow clients")
	resp.Body.Close()
	require.Less(t, resp.StatusCode, 300)
	require.Less(t, time.Since(start), 3*time.Second)

	// A silent body is cut after the grace (2 s here), far before
	// ReadTimeout (30 s).
	c := held[silent]
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	start = time.Now()
	buf := make([]byte, 512)
	for {
		if _, err := c.Read(buf); err != nil {
			break
		}
	}
	require.Less(t, time.Since(start), 6*time.Second, "the silent body's connection was closed")
}

func listenAddr(t *testing.T, logs, line string) string {
	t.Helper()
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, line) {
			i := strings.Index(l, "addr=")
			require.Positive(t, i, l)
			return strings.Fields(l[i+len("addr="):])[0]
		}
	}
	t.Fatalf("no %q in the logs:\n%s", line, logs)
	return ""
}
