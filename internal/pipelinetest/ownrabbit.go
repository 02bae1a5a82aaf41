package pipelinetest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// RabbitNode is a RabbitMQ node of a test's own (see OwnRabbit).
type RabbitNode struct {
	// Config connects to the node, with a namespace of the test's own.
	Config rabbit.Config
	// Restart is a command that restarts the node (stop_app, start_app);
	// restarts are serialised, and each one that completes is counted.
	Restart []string
	dir     string
	name    string
	env     []string
}

// Ctl runs rabbitmqctl against the node (stop_app, start_app, ...).
func (n *RabbitNode) Ctl(t testing.TB, args ...string) {
	t.Helper()
	cmd := exec.Command("rabbitmqctl", append([]string{"-n", n.name}, args...)...)
	cmd.Env = n.env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("rabbitmqctl %v on the test's node: %v\n%s", args, err, out)
	}
}

// AwaitRestarts waits until n restarts have completed and the node accepts
// connections again: a test whose restarts run in the background (as
// Watermill's TestReconnect's do) calls it before its cleanups talk to the
// node, or stop it, mid-restart.
func (n *RabbitNode) AwaitRestarts(t testing.TB, count int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, _ := os.ReadFile(filepath.Join(n.dir, "restarts"))
		if len(b) >= count {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d broker restarts completed within %s", len(b), count, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for {
		conn, err := amqp.DialConfig(n.Config.URL, amqp.Config{Dial: amqp.DefaultDial(time.Second)})
		if err == nil {
			_ = conn.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the test's RabbitMQ node did not come back after its restarts: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// OwnRabbit starts a RabbitMQ node of the test's own (rabbitmq-server from
// the machine's package, on free loopback ports, data in a temporary
// directory) for tests that must stop or restart the broker without
// touching the shared one. The node is stopped and its files removed when
// the test ends.
func OwnRabbit(t testing.TB) *RabbitNode {
	t.Helper()
	skipShort(t)
	server, err := exec.LookPath("rabbitmq-server")
	if err != nil {
		t.Fatalf("this test runs a RabbitMQ node of its own and needs rabbitmq-server: %v (apt-get install rabbitmq-server)", err)
	}
	ctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		t.Fatalf("this test needs rabbitmqctl: %v", err)
	}
	dir, err := os.MkdirTemp("", "ferry-rabbit-")
	if err != nil {
		t.Fatal(err)
	}
	port, dist := freePort(t), freePort(t)
	node := UniqueName("ferrytest") + "@localhost"
	conf := fmt.Sprintf("listeners.tcp.default = 127.0.0.1:%d\n", port)
	if err := os.WriteFile(filepath.Join(dir, "rabbitmq.conf"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "plugins"), []byte("[].\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// rabbitmq-server started as root drops to the rabbitmq user: it must
	// own its directory.
	if u, err := user.Lookup("rabbitmq"); err == nil && os.Geteuid() == 0 {
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		_ = filepath.Walk(dir, func(p string, _ os.FileInfo, _ error) error { return os.Lchown(p, uid, gid) })
	}
	env := append(os.Environ(),
		"RABBITMQ_NODENAME="+node,
		"RABBITMQ_DIST_PORT="+strconv.Itoa(dist),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(dir, "rabbitmq"),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(dir, "plugins"),
		"RABBITMQ_PID_FILE="+filepath.Join(dir, "pid"),
	)
	start := exec.Command(server, "-detached")
	start.Env = env
	if out, err := start.CombinedOutput(); err != nil {
		t.Fatalf("starting a RabbitMQ node of the test's own: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		stop := exec.Command(ctl, "-n", node, "stop")
		stop.Env = env
		if out, err := stop.CombinedOutput(); err != nil {
			t.Errorf("stopping the test's RabbitMQ node %s: %v\n%s", node, err, out)
		}
		_ = os.RemoveAll(dir)
	})
	url := fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for {
		conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(time.Second)})
		if err == nil {
			_ = conn.Close()
			break
		}
		select {
		case <-ctx.Done():
			logs, _ := os.ReadFile(filepath.Join(dir, "log", node+".log"))
			t.Fatalf("the test's RabbitMQ node did not accept connections within 90s: %v\n%s", err, logs)
		case <-time.After(250 * time.Millisecond):
		}
	}
	// One restart at a time: a stop_app during another restart's start_app
	// fails (rabbitmqctl exit 69), and callers may restart concurrently.
	// Each completed restart appends one byte to the restarts file
	// (AwaitRestarts counts them).
	restart := []string{"flock", filepath.Join(dir, "restart.lock"), "sh", "-c",
		fmt.Sprintf("%[1]s -n %[2]s stop_app && %[1]s -n %[2]s start_app && %[1]s -n %[2]s await_startup && printf x >> %[3]s",
			ctl, node, filepath.Join(dir, "restarts"))}
	return &RabbitNode{Config: rabbit.Config{URL: url, Namespace: UniqueName("ferrytest.") + "."}, Restart: restart, dir: dir, name: node, env: env}
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// OwnRabbitCluster starts n RabbitMQ nodes of the test's own (OwnRabbit)
// and joins them into one cluster (rabbitmqctl join_cluster to the first):
// for tests that lose a node. Each node's Config.URL reaches that node; the
// namespace is the first's, shared.
func OwnRabbitCluster(t testing.TB, n int) []*RabbitNode {
	t.Helper()
	nodes := make([]*RabbitNode, n)
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := range nodes {
		wg.Go(func() {
			node := OwnRabbit(t)
			mu.Lock()
			nodes[i] = node
			mu.Unlock()
		})
	}
	wg.Wait()
	for _, node := range nodes {
		if node == nil {
			t.FailNow() // OwnRabbit said why
		}
	}
	for _, node := range nodes[1:] {
		node.Ctl(t, "stop_app")
		node.Ctl(t, "join_cluster", nodes[0].name)
		node.Ctl(t, "start_app")
		node.Ctl(t, "await_startup")
		node.Config.Namespace = nodes[0].Config.Namespace
	}
	return nodes
}

// Name is the node's Erlang name (rabbit@host), as the cluster lists it.
func (n *RabbitNode) Name() string { return n.name }

// CtlOutput runs rabbitmqctl against the node and returns what it printed.
func (n *RabbitNode) CtlOutput(t testing.TB, args ...string) string {
	t.Helper()
	cmd := exec.Command("rabbitmqctl", append([]string{"-n", n.name}, args...)...)
	cmd.Env = n.env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl %v on the test's node: %v\n%s", args, err, out)
	}
	return string(out)
}

// Kill ends the node's Erlang VM with SIGKILL: a crash, nothing flushed.
func (n *RabbitNode) Kill(t testing.TB) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(n.dir, "pid"))
	if err != nil {
		t.Fatalf("reading the node's pid file: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("the node's pid file: %v", err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("killing the node: %v", err)
	}
	for syscall.Kill(pid, 0) == nil {
		time.Sleep(50 * time.Millisecond)
	}
}

// Start starts a node that was killed, with its data, and waits until it
// accepts connections.
func (n *RabbitNode) Start(t testing.TB) {
	t.Helper()
	start := exec.Command("rabbitmq-server", "-detached")
	start.Env = n.env
	if out, err := start.CombinedOutput(); err != nil {
		t.Fatalf("starting the node again: %v\n%s", err, out)
	}
	n.Ctl(t, "wait", filepath.Join(n.dir, "pid"), "--timeout", "90")
	n.Ctl(t, "await_startup")
}
