package pipelinetest

import (
	"context"
	"errors"
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
	n.Output(t, args...)
}

// Output runs rabbitmqctl against the node and returns what it printed
// (list_queues ...).
func (n *RabbitNode) Output(t testing.TB, args ...string) string {
	t.Helper()
	out, err := n.ctl(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Run is Ctl for callers without a test: the chaos run.
func (n *RabbitNode) Run(args ...string) error {
	_, err := n.ctl(args...)
	return err
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

// OwnRabbit starts a RabbitMQ node of the test's own (StartRabbit) for
// tests that must stop or restart the broker without touching the shared
// one. The node is stopped and its files removed when the test ends.
func OwnRabbit(t testing.TB) *RabbitNode {
	t.Helper()
	skipShort(t)
	n, err := StartRabbit(context.Background())
	if err != nil {
		t.Fatalf("this test runs a RabbitMQ node of its own: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("stopping the test's RabbitMQ node: %v", err)
		}
	})
	return n
}

// StartRabbit starts a RabbitMQ node of its own (rabbitmq-server from the
// machine's package, on free loopback ports, data in a temporary
// directory) and waits until it accepts connections. Close stops it and
// removes its files.
func StartRabbit(ctx context.Context) (*RabbitNode, error) {
	server, err := exec.LookPath("rabbitmq-server")
	if err != nil {
		return nil, fmt.Errorf("rabbitmq-server is needed: %w (apt-get install rabbitmq-server)", err)
	}
	ctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		return nil, fmt.Errorf("rabbitmqctl is needed: %w", err)
	}
	dir, err := os.MkdirTemp("", "ferry-rabbit-")
	if err != nil {
		return nil, err
	}
	port, err := freeLoopbackPort()
	if err != nil {
		return nil, err
	}
	dist, err := freeLoopbackPort()
	if err != nil {
		return nil, err
	}
	node := UniqueName("ferrytest") + "@localhost"
	conf := fmt.Sprintf("listeners.tcp.default = 127.0.0.1:%d\n", port)
	if err := os.WriteFile(filepath.Join(dir, "rabbitmq.conf"), []byte(conf), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "plugins"), []byte("[].\n"), 0o644); err != nil {
		return nil, err
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
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("starting a RabbitMQ node: %w\n%s", err, out)
	}
	// One restart at a time: a stop_app during another restart's start_app
	// fails (rabbitmqctl exit 69), and callers may restart concurrently.
	// Each completed restart appends one byte to the restarts file
	// (AwaitRestarts counts them).
	restart := []string{"flock", filepath.Join(dir, "restart.lock"), "sh", "-c",
		fmt.Sprintf("%[1]s -n %[2]s stop_app && %[1]s -n %[2]s start_app && %[1]s -n %[2]s await_startup && printf x >> %[3]s",
			ctl, node, filepath.Join(dir, "restarts"))}
	url := fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)
	n := &RabbitNode{Config: rabbit.Config{URL: url, Namespace: UniqueName("ferrytest.") + "."}, Restart: restart, dir: dir, name: node, env: env}
	// Three nodes booting at once at the end of a CI run on two busy
	// cores once took longer than 90 s: a bound for a node that will
	// not start, not a target.
	wctx, cancel := context.WithTimeout(ctx, nodeStartBound)
	defer cancel()
	for {
		conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(time.Second)})
		if err == nil {
			_ = conn.Close()
			return n, nil
		}
		select {
		case <-wctx.Done():
			logs, _ := os.ReadFile(filepath.Join(dir, "log", node+".log"))
			_ = n.Close()
			return nil, fmt.Errorf("the RabbitMQ node did not accept connections within %s: %v\n%s", nodeStartBound, err, logs)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// nodeStartBound is how long StartRabbit waits for its node to accept
// connections.
const nodeStartBound = 180 * time.Second

// Close stops the node, if it runs, and removes its files.
func (n *RabbitNode) Close() error {
	var err error
	if n.running() {
		cmd := exec.Command("rabbitmqctl", "-n", n.name, "stop")
		cmd.Env = n.env
		if out, cerr := cmd.CombinedOutput(); cerr != nil {
			err = fmt.Errorf("stopping RabbitMQ node %s: %w\n%s", n.name, cerr, out)
		}
	}
	return errors.Join(err, os.RemoveAll(n.dir))
}

// running reports whether the node's VM is alive (its pid file names a
// live process).
func (n *RabbitNode) running() bool {
	b, err := os.ReadFile(filepath.Join(n.dir, "pid"))
	if err != nil {
		return true // not written yet: stop it to be sure
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return err != nil || syscall.Kill(pid, 0) == nil
}

func freeLoopbackPort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// OwnRabbitCluster starts a cluster of n nodes of the test's own
// (StartRabbitCluster), stopped and removed when the test ends.
func OwnRabbitCluster(t testing.TB, n int) []*RabbitNode {
	t.Helper()
	skipShort(t)
	nodes, err := StartRabbitCluster(context.Background(), n)
	if err != nil {
		t.Fatalf("this test runs a RabbitMQ cluster of its own: %v", err)
	}
	t.Cleanup(func() {
		for _, node := range nodes {
			if err := node.Close(); err != nil {
				t.Errorf("stopping the test's RabbitMQ nodes: %v", err)
			}
		}
	})
	return nodes
}

// StartRabbitCluster starts n RabbitMQ nodes (StartRabbit) and joins them
// into one cluster (rabbitmqctl join_cluster to the first). Each node's
// Config.URL reaches that node; the namespace is the first's, shared.
func StartRabbitCluster(ctx context.Context, n int) ([]*RabbitNode, error) {
	nodes := make([]*RabbitNode, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() { nodes[i], errs[i] = StartRabbit(ctx) })
	}
	wg.Wait()
	closeAll := func() {
		for _, node := range nodes {
			if node != nil {
				_ = node.Close()
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		closeAll()
		return nil, err
	}
	for _, node := range nodes[1:] {
		for _, args := range [][]string{{"stop_app"}, {"join_cluster", nodes[0].name}, {"start_app"}, {"await_startup"}} {
			if _, err := node.ctl(args...); err != nil {
				closeAll()
				return nil, err
			}
		}
		node.Config.Namespace = nodes[0].Config.Namespace
	}
	return nodes, nil
}

func (n *RabbitNode) ctl(args ...string) (string, error) {
	cmd := exec.Command("rabbitmqctl", append([]string{"-n", n.name}, args...)...)
	cmd.Env = n.env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("rabbitmqctl %v on node %s: %w\n%s", args, n.name, err, out)
	}
	return string(out), nil
}

// Name is the node's Erlang name (rabbit@host), as the cluster lists it.
func (n *RabbitNode) Name() string { return n.name }

// CtlOutput runs rabbitmqctl against the node and returns what it printed.
func (n *RabbitNode) CtlOutput(t testing.TB, args ...string) string {
	t.Helper()
	out, err := n.ctl(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
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
