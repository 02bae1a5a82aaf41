package invoices_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/examples/invoices"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// A service's own test, as its team writes it: ferrytest.App starts the
// service (its route table, link and migrations) in a schema and a broker
// namespace of its own, and removes both at the end.
func TestInvoicesWithTheAppHelper(t *testing.T) {
	t.Parallel()
	// snippet:begin app-test
	a := ferrytest.App(t, invoices.Options())
	ctx := context.Background()
	good, err := invoices.Issue(ctx, a.Pool(), a.Outbox(), "acme", "bob", 1200)
	require.NoError(t, err)
	orphan, err := invoices.Issue(ctx, a.Pool(), a.Outbox(), "", "eve", 300)
	require.NoError(t, err)

	ferrytest.RequireHandled(t, a.Pool(), a.Routes(), 30*time.Second)
	var sent, orphanSent bool
	require.NoError(t, a.Pool().QueryRow(ctx, `SELECT sent_at IS NOT NULL FROM invoices WHERE id = $1`, good).Scan(&sent))
	require.NoError(t, a.Pool().QueryRow(ctx, `SELECT sent_at IS NOT NULL FROM invoices WHERE id = $1`, orphan).Scan(&orphanSent))
	require.True(t, sent)
	require.False(t, orphanSent)
	poisoned, err := a.Poison().List(ctx, "", 0)
	require.NoError(t, err)
	require.Len(t, poisoned, 1)
	require.Contains(t, poisoned[0].Reason, pipeline.MetaTenantID)
	// snippet:end app-test
}

// Delivered twice, effect once: the broker delivers the issued event again
// (ferrytest.Redeliver waits until the handler has seen the copy), and the
// invoice is still sent once, with one invoice.sent event.
func TestInvoicesDeliveredTwiceSentOnce(t *testing.T) {
	t.Parallel()
	a := ferrytest.App(t, invoices.Options())
	ctx := context.Background()
	id, err := invoices.Issue(ctx, a.Pool(), a.Outbox(), "acme", "bob", 1200)
	require.NoError(t, err)
	ferrytest.RequireHandled(t, a.Pool(), a.Routes(), 30*time.Second)
	events := func(topic string) []pgoutbox.Row {
		rows, err := a.OutboxTable().Rows(ctx, a.Pool(), pgoutbox.RowFilter{Topic: topic, AggregateID: strconv.FormatInt(id, 10)})
		require.NoError(t, err)
		return rows
	}
	issued := events(invoices.TopicIssued)[0].MessageID

	ferrytest.Redeliver(t, a, issued, 30*time.Second)
	require.Len(t, events(invoices.TopicSent), 1, "the redelivery ran no effect: one invoice.sent event")
}

// syncBuffer is a buffer exec's copier writes while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The user's application end to end, as its team would run it: build its
// binary, migrate with it (Ferry's tables and the service's own), run it,
// issue invoices through the library, and read the outcome with its own
// operations commands.
func TestInvoicesServiceEndToEnd(t *testing.T) {
	rcfg := ferrytest.Rabbit(t)
	schema := ferrytest.UniqueName("ferry_invoices_")
	admin := ferrytest.Pool(t, "", "ferry-test-invoices-admin")
	t.Cleanup(func() { _ = pgdb.DropSchema(context.Background(), admin, schema) })
	// Record what the service will declare, so the test removes it all.
	topo, err := rabbit.NewTopology(rcfg)
	require.NoError(t, err)
	ferrytest.TeardownTopology(t, topo)
	conn, err := amqp.Dial(rcfg.URL)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, topo.Declare(conn, rabbit.Binding{Topic: invoices.TopicIssued, Queue: invoices.RouteMarkSent}))
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, topo.ExchangeDeclare(ch, topo.ExchangeName(invoices.TopicSent), topo.PublisherConfig()))
	ch.Close()

	bin := filepath.Join(t.TempDir(), "invoices")
	build := exec.Command("go", "build", "-o", bin, "./cmd/invoices")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building the service: %s", out)
	env := append(os.Environ(),
		"FERRY_DATABASE_URL="+ferrytest.DatabaseURL(), "FERRY_DATABASE_SCHEMA="+schema,
		"FERRY_AMQP_URL="+rcfg.URL, "FERRY_AMQP_NAMESPACE="+rcfg.Namespace,
		// A poll far longer than the test: the service publishes as the
		// README shows, calling nothing after its commits, and only the
		// relay's probe (on by default) can find them in time.
		"FERRY_ADMIN_ADDR=off", "FERRY_RELAY_POLL_INTERVAL=1h", "FERRY_LOG_FORMAT=json",
		"FERRY_RETRY_INITIAL_INTERVAL=5ms", "FERRY_RETRY_MAX_INTERVAL=10ms")
	cmd := func(args ...string) (string, error) {
		c := exec.Command(bin, args...)
		c.Env = env
		var buf bytes.Buffer
		c.Stdout, c.Stderr = &buf, &buf
		err := c.Run()
		return buf.String(), err
	}

	help, err := cmd("-h")
	require.NoError(t, err, help)
	for _, want := range []string{"invoices: issues invoices", "run [--migrate]", "migrate up", "poison requeue", "status"} {
		require.Contains(t, help, want)
	}
	runHelp, err := cmd("run", "-h")
	require.NoError(t, err, runHelp)
	require.Contains(t, runHelp, "-migrate")

	migrated, err := cmd("migrate", "up")
	require.NoError(t, err, migrated)
	require.Contains(t, migrated, "ferry: applied")
	require.Contains(t, migrated, "invoices: applied 1 migration(s)")

	run := exec.Command(bin, "run")
	run.Env = env
	var logs syncBuffer // written by exec's copier while the test reads it
	run.Stdout, run.Stderr = &logs, &logs
	require.NoError(t, run.Start())
	stopped := false
	defer func() {
		if !stopped {
			_ = run.Process.Kill()
			_ = run.Wait()
		}
	}()

	pool := ferrytest.Pool(t, schema, "ferry-test-invoices")
	outbox, err := pgoutbox.New(pgoutbox.Config{}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	// The invoices are issued once the relay idles (its first claim found
	// nothing): with no wake-up from this process and a poll of an hour,
	// only its probe finds them. Issued before it started, its first claim
	// would take them, and the test would pass without the probe.
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), `"msg":"relay started"`) }, 60*time.Second, 10*time.Millisecond,
		"the service did not start its relay; logs:\n%s", &logs)
	time.Sleep(500 * time.Millisecond)
	good, err := invoices.Issue(ctx, pool, outbox, "acme", "bob", 1200)
	require.NoError(t, err)
	orphan, err := invoices.Issue(ctx, pool, outbox, "", "eve", 300) // no tenant: the service's link refuses it
	require.NoError(t, err)

	ferrytest.RequireHandled(t, pool, []handlers.Route{{Name: invoices.RouteMarkSent, Topic: invoices.TopicIssued}}, 60*time.Second)

	var sent, orphanSent bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT sent_at IS NOT NULL FROM invoices WHERE id = $1`, good).Scan(&sent))
	require.NoError(t, pool.QueryRow(ctx, `SELECT sent_at IS NOT NULL FROM invoices WHERE id = $1`, orphan).Scan(&orphanSent))
	require.True(t, sent, "the handler marked the invoice sent; logs:\n%s", logs.String())
	require.False(t, orphanSent, "an event without tenant never reaches the handler")
	follow, err := pgoutbox.Table{}.Rows(ctx, pool, pgoutbox.RowFilter{Topic: invoices.TopicSent})
	require.NoError(t, err)
	require.Len(t, follow, 1)
	require.Equal(t, "acme", follow[0].Headers["tenant_id"], "the follow-up event was written in the ledger transaction, with the tenant the link put in the context")

	list, err := cmd("poison", "list", "--json")
	require.NoError(t, err, list)
	var poisoned []struct {
		Handler, Reason string
		Permanent       bool
	}
	require.NoError(t, json.Unmarshal([]byte(list), &poisoned), list)
	require.Len(t, poisoned, 1)
	require.Equal(t, invoices.RouteMarkSent, poisoned[0].Handler)
	require.Contains(t, poisoned[0].Reason, pipeline.MetaTenantID)
	require.True(t, poisoned[0].Permanent)

	// Something needs a human (the poisoned invoice): status says so and
	// exits 3; --exit-code=false prints the same and exits 0.
	status, err := cmd("status")
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, status)
	require.Equal(t, 3, exit.ExitCode(), status)
	require.Contains(t, status, "poison store: 1 message(s)")
	require.Contains(t, status, "needs attention:")
	status, err = cmd("status", "--exit-code=false")
	require.NoError(t, err, status)

	require.NoError(t, run.Process.Signal(syscall.SIGTERM))
	require.NoError(t, run.Wait(), "graceful stop; logs:\n%s", logs.String())
	stopped = true
	require.False(t, strings.Contains(logs.String(), `"level":"ERROR"`), "no error logged:\n%s", logs.String())
}
