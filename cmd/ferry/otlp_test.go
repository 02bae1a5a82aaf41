package main

import (
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// otlpReceiver collects the spans OTLP/HTTP exporters send it.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []*tracepb.Span
	proc  map[string]string // span id -> the exporting process's pid
}

func (o *otlpReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil || r.URL.Path != "/v1/traces" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(body, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, rs := range req.ResourceSpans {
		pid := ""
		for _, a := range rs.GetResource().GetAttributes() {
			if a.Key == "process.pid" {
				pid = a.GetValue().String()
			}
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				o.spans = append(o.spans, s)
				o.proc[hex.EncodeToString(s.SpanId)] = pid
			}
		}
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	_, _ = w.Write(out)
}

func (o *otlpReceiver) pid(s *tracepb.Span) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.proc[hex.EncodeToString(s.SpanId)]
}

// trace returns the spans of the trace that contains a span named name.
func (o *otlpReceiver) trace(name string) []*tracepb.Span {
	o.mu.Lock()
	defer o.mu.Unlock()
	var id []byte
	for _, s := range o.spans {
		if s.Name == name {
			id = s.TraceId
		}
	}
	var out []*tracepb.Span
	for _, s := range o.spans {
		if id != nil && string(s.TraceId) == string(id) {
			out = append(out, s)
		}
	}
	return out
}

// With the standard OTEL_* variables set, every process exports its spans
// over OTLP, and one order is one connected trace across `ferry serve`,
// `ferry relay` and `ferry consume`: the HTTP request, the relay's publish
// (from the stored trace context), the consumer's handler, and its call
// to the payment provider, which receives the trace's traceparent.
func TestOneOrderIsOneTraceOverOTLP(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	recv := &otlpReceiver{proc: map[string]string{}}
	collector := httptest.NewServer(recv)
	defer collector.Close()
	world, err := sandbox.StartWorld()
	require.NoError(t, err)
	defer world.Close()
	pipelinetest.Rabbit(t)
	vhost := ownVhost(t, "ferry_test_otlp_")
	schema := pipelinetest.Schema(t)
	bin := buildFerry(t)

	// Three processes, as a scaled deployment runs them: the API (which
	// migrates), the relay and the consumers.
	api := "127.0.0.1:" + freeTestPort(t)
	env := append(os.Environ(),
		"FERRY_DATABASE_URL="+pipelinetest.DatabaseURL(), "FERRY_DATABASE_SCHEMA="+schema,
		"FERRY_AMQP_URL="+pipelinetest.AMQPURLWithVhost(t, vhost),
		"FERRY_HTTP_ADDR="+api, "FERRY_ADMIN_ADDR=off", "FERRY_LOG_LEVEL=warn", "FERRY_RELAY_POLL_INTERVAL=50ms",
		"FERRY_PAYMENT_URL="+world.Payments.URL(), "FERRY_SMTP_ADDR="+world.SMTP.Addr(),
		"OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL, "OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_SERVICE_NAME=ferry-otlp-test")
	var logs pipelinetest.SyncBuffer
	var procs []*exec.Cmd
	startProc := func(args ...string) { procs = append(procs, startFerry(t, bin, env, &logs, args...)) }
	startProc("serve", "--migrate")
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + api + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return true
	}, 60*time.Second, 100*time.Millisecond, "the API never listened: %s", logs.String())
	startProc("relay")
	startProc("consume")

	require.Eventually(t, func() bool {
		status, err := postOrder(api, "otlp-1", `{"user_id":"tracy","amount":700,"currency":"JPY"}`)
		return err == nil && status < 300
	}, 60*time.Second, 200*time.Millisecond, "the API never took the order: %s", logs.String())
	require.Eventually(t, func() bool { return len(world.Payments.Charges()) == 1 }, 30*time.Second, 50*time.Millisecond, logs.String())
	for _, p := range procs {
		require.NoError(t, p.Process.Signal(syscall.SIGTERM))
	}
	for _, p := range procs {
		require.NoError(t, p.Wait(), logs.String()) // the exporter flushes at exit
	}

	spans := recv.trace("POST /orders")
	require.NotEmpty(t, spans, "no trace with the request's span: %d spans received", len(recv.spans))
	kinds := map[tracepb.Span_SpanKind][]string{}
	ids := map[string]*tracepb.Span{}
	for _, s := range spans {
		kinds[s.Kind] = append(kinds[s.Kind], s.Name)
		ids[hex.EncodeToString(s.SpanId)] = s
	}
	require.Contains(t, kinds[tracepb.Span_SPAN_KIND_SERVER], "POST /orders")
	require.Contains(t, strings.Join(kinds[tracepb.Span_SPAN_KIND_PRODUCER], " "), "publish stripe.charge", "the relay's publish is in the request's trace")
	require.NotEmpty(t, kinds[tracepb.Span_SPAN_KIND_CONSUMER], "the handler's span is in it")
	require.NotEmpty(t, kinds[tracepb.Span_SPAN_KIND_CLIENT], "the call to the provider is in it")
	// Connected: every span but the root has its parent in the trace.
	for _, s := range spans {
		if len(s.ParentSpanId) == 0 {
			require.Equal(t, "POST /orders", s.Name, "the one root is the request")
			continue
		}
		_, ok := ids[hex.EncodeToString(s.ParentSpanId)]
		require.True(t, ok, "span %q has its parent in the trace", s.Name)
	}
	require.Equal(t, hex.EncodeToString(spans[0].TraceId), world.Payments.Charges()[0].TraceID, "the provider got the trace's traceparent")
	// Across the three processes: the request's, the publish's and the
	// handler's spans each come from another one.
	pidOf := func(kind tracepb.Span_SpanKind) string {
		for _, s := range spans {
			if s.Kind == kind {
				return recv.pid(s)
			}
		}
		return ""
	}
	pids := map[string]bool{pidOf(tracepb.Span_SPAN_KIND_SERVER): true, pidOf(tracepb.Span_SPAN_KIND_PRODUCER): true, pidOf(tracepb.Span_SPAN_KIND_CONSUMER): true}
	delete(pids, "")
	require.Len(t, pids, 3, "one trace across the API, the relay and the consumer processes")
}

// buildFerry builds this binary into the test's directory.
func buildFerry(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "ferry")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "building ferry: %s", out)
	return bin
}

// ownVhost adds a RabbitMQ vhost for the test (prefix and random hex),
// deleted when it ends: deleting it removes whatever the processes declared.
func ownVhost(t *testing.T, prefix string) string {
	t.Helper()
	vhost := pipelinetest.UniqueName(prefix)
	require.NoError(t, exec.Command("rabbitmqctl", "-q", "add_vhost", vhost).Run())
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "-q", "delete_vhost", vhost).Run() })
	require.NoError(t, exec.Command("rabbitmqctl", "-q", "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*").Run())
	return vhost
}

// startFerry starts bin with args and env, its output into logs; a process
// the test has not waited for is killed when it ends.
func startFerry(t *testing.T, bin string, env []string, logs *pipelinetest.SyncBuffer, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd
}

// postOrder posts body to the API's /orders with an idempotency key and
// returns the status.
func postOrder(api, key, body string) (int, error) {
	req, err := http.NewRequest(http.MethodPost, "http://"+api+"/orders", strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

func freeTestPort(t *testing.T) string {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return port
}

// `ferry serve` is the producers' side: it takes orders into the outbox
// while the broker is down (nothing listens on FERRY_AMQP_URL's port).
func TestServeTakesOrdersWithTheBrokerDown(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL; skipped with -short")
	}
	schema := pipelinetest.Schema(t)
	bin := buildFerry(t)
	api := "127.0.0.1:" + freeTestPort(t)
	var logs pipelinetest.SyncBuffer
	cmd := startFerry(t, bin, append(os.Environ(), "FERRY_DATABASE_URL="+pipelinetest.DatabaseURL(), "FERRY_DATABASE_SCHEMA="+schema,
		"FERRY_AMQP_URL=amqp://guest:guest@127.0.0.1:"+freeTestPort(t)+"/", "FERRY_HTTP_ADDR="+api, "FERRY_ADMIN_ADDR=off", "FERRY_LOG_LEVEL=warn"),
		&logs, "serve", "--migrate")
	var status int
	require.Eventually(t, func() bool {
		var err error
		status, err = postOrder(api, "serve-1", `{"user_id":"ada","amount":700,"currency":"JPY"}`)
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "the API never answered: %s", logs.String())
	require.Less(t, status, 300, logs.String())
	pool := pipelinetest.Pool(t, schema, "ferry-test-serve")
	pending, err := pgoutbox.Table{}.PendingCount(context.Background(), pool)
	require.NoError(t, err)
	require.Positive(t, pending, "the order's events wait in the outbox for a relay")
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), logs.String())
}

// During an SMTP and a payment provider outage `ferry status` names where
// messages wait: the mails retrying (with why), the ordered charges'
// partition held behind its head, the charges queued behind it on the
// broker; and it exits non-zero. The state is real: `ferry run` against
// a provider answering 503 and an SMTP port nobody listens on.
func TestStatusDuringAnOutageNamesWhereMessagesWait(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	world, err := sandbox.StartWorld()
	require.NoError(t, err)
	defer world.Close()
	pipelinetest.Rabbit(t)
	vhost := ownVhost(t, "ferry_test_outage_")
	schema := pipelinetest.Schema(t)
	bin := buildFerry(t)

	api := "127.0.0.1:" + freeTestPort(t)
	env := map[string]string{
		"FERRY_DATABASE_URL": pipelinetest.DatabaseURL(), "FERRY_DATABASE_SCHEMA": schema,
		"FERRY_AMQP_URL": pipelinetest.AMQPURLWithVhost(t, vhost), "FERRY_ORDERED_TOPICS": "stripe.charge", "FERRY_AMQP_PARTITIONS": "1",
		"FERRY_DURABLE_RETRY_INITIAL": "1m", "FERRY_PAYMENT_URL": world.Payments.URL(),
		"FERRY_SMTP_ADDR": "127.0.0.1:" + freeTestPort(t), // the SMTP outage: nothing listens
	}
	runEnv := append(os.Environ(), "FERRY_HTTP_ADDR="+api, "FERRY_ADMIN_ADDR=off", "FERRY_LOG_LEVEL=warn", "FERRY_RELAY_POLL_INTERVAL=50ms")
	for k, v := range env {
		runEnv = append(runEnv, k+"="+v)
	}
	var logs pipelinetest.SyncBuffer
	startFerry(t, bin, runEnv, &logs, "run", "--migrate")
	order := func(key string) {
		t.Helper()
		require.Eventually(t, func() bool {
			status, err := postOrder(api, key, `{"user_id":"ada","amount":700,"currency":"JPY"}`)
			return err == nil && status < 300
		}, 60*time.Second, 100*time.Millisecond, "the API never took the order: %s", logs.String())
	}
	// Two orders charged while the provider is up (every order's mail
	// retries: the SMTP server is down all along).
	order("outage-1")
	order("outage-2")
	require.Eventually(t, func() bool { return len(world.Payments.Charges()) == 2 }, 30*time.Second, 50*time.Millisecond, logs.String())
	// Then the provider fails: the next charge holds the one partition,
	// the two after it wait in the broker's queue.
	world.Payments.FailNext(1_000_000)
	for _, k := range []string{"outage-3", "outage-4", "outage-5"} {
		order(k)
	}
	for k, v := range env {
		t.Setenv(k, v)
	}
	var status string
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		var out, errOut strings.Builder
		code := run([]string{"status"}, &out, &errOut)
		status = out.String() + errOut.String()
		if code == 3 && strings.Contains(status, "5 message(s) retrying") && strings.Contains(status, "held since") &&
			regexp.MustCompile(`payments\.charge@0 +2 +1\n`).MatchString(status) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("status (exit %d) never named the outage's waits:\n%s\nlogs: %s", code, status, logs.String())
		}
	}
	attention := status[strings.Index(status, "needs attention:"):]
	require.Contains(t, attention, "5 message(s) retrying (most: 5 for notifications.mail")
	require.Contains(t, attention, "ordered partition payments.charge@0 held since")
	require.Contains(t, attention, "503")
}
