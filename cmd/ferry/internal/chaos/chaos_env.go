package chaos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cmd/ferry/internal/wait"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The run's environment: its own servers, the child processes it starts,
// kills and rolls, and what it removes at the end.

type child struct {
	role string
	cmd  *exec.Cmd
	done chan struct{}
	// links are the child's own proxies (linkProxies), nil without them.
	links *childLinks
}

type chaosEnv struct {
	bin string
	env []string
	// version, if set, is the event version children started now run
	// (FERRY_CHAOS_EVENT_VERSION): the version roll changes it.
	version atomic.Value
	// placed counts the orders the driver has placed: the version roll's
	// consumer steps follow it, as its producer steps do (by time, a
	// slow run had the consumers roll before the producers).
	placed   atomic.Int64
	logDir   string
	mu       sync.Mutex
	children []*child
	logger   *slog.Logger
	// links, if set, puts each relay, consumer and `ferry run` started
	// behind proxies of its own, for the network faults.
	links *linkProxies
	// appName is the children's application name; a child behind proxies
	// gets appName-<role>-<n>, so that its sessions can be told apart.
	appName string
	started atomic.Int64
	// network are the network run's processes, A then B.
	network []*child
}

// startOwnPostgres starts a PostgreSQL server of the run's own with the
// run's database; the caller stops it.
func startOwnPostgres(ctx context.Context) (*pipelinetest.PostgresServer, error) {
	pg, err := pipelinetest.StartPostgres(ctx)
	if err != nil {
		return nil, fmt.Errorf("starting the run's own PostgreSQL: %w", err)
	}
	if err := pg.Exec(ctx, "postgres", "CREATE DATABASE "+chaosDatabase); err != nil {
		_ = pg.Stop()
		return nil, err
	}
	return pg, nil
}

func (e *chaosEnv) start(role string, extra ...string) (*child, error) {
	return e.startAs(role, role, extra...)
}

// startAs starts `bin role`, logging to name.log.
func (e *chaosEnv) startAs(name, role string, extra ...string) (*child, error) {
	logf, err := os.OpenFile(filepath.Join(e.logDir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(e.bin, role)
	cmd.Env = append(append(os.Environ(), e.env...), extra...)
	if v, _ := e.version.Load().(string); v != "" {
		cmd.Env = append(cmd.Env, "FERRY_CHAOS_EVENT_VERSION="+v)
	}
	var links *childLinks
	if e.links != nil && (role == "relay" || role == "consume" || role == "run") {
		var err error
		if links, err = e.links.open(fmt.Sprintf("%s-%s-%d", e.appName, role, e.started.Add(1))); err != nil {
			logf.Close()
			return nil, err
		}
		cmd.Env = append(cmd.Env, links.env...)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		links.close()
		return nil, fmt.Errorf("starting %s: %w", role, err)
	}
	c := &child{role: role, cmd: cmd, done: make(chan struct{}), links: links}
	go func() { _ = cmd.Wait(); logf.Close(); links.close(); close(c.done) }()
	e.mu.Lock()
	e.children = append(e.children, c)
	e.mu.Unlock()
	return c, nil
}

// live returns the children of role still running.
func (e *chaosEnv) live(role string) []*child {
	e.mu.Lock()
	defer e.mu.Unlock()
	var live []*child
	for _, c := range e.children {
		select {
		case <-c.done:
		default:
			if c.role == role {
				live = append(live, c)
			}
		}
	}
	return live
}

// kill SIGKILLs one live child of role and starts a replacement.
// It reports whether it killed anything: with no live child of role (all
// stopped by another fault meanwhile) it only starts one, and that is no
// kill to count.
func (e *chaosEnv) killAndRestart(rng *rand.Rand, role string, extra ...string) (bool, error) {
	live := e.live(role)
	if len(live) == 0 {
		_, err := e.start(role, extra...)
		return false, err
	}
	victim := live[rng.IntN(len(live))]
	killed := victim.cmd.Process.Signal(syscall.SIGKILL) == nil
	<-victim.done
	_, err := e.start(role, extra...)
	return killed, err
}

// roll restarts every live child of role, one at a time, as a Deployment
// rolls: a replacement is started and waited for (its heartbeat row), then
// the old process gets sig and is waited for. It returns how many it
// stopped. A process that does not stop within stopWait is killed and
// reported: a graceful stop must end within the shutdown timeout.
func (e *chaosEnv) roll(ctx context.Context, pool *pgxpool.Pool, role string, sig syscall.Signal, stopWait time.Duration, extra func() string) (int, error) {
	stopped := 0
	for _, victim := range e.live(role) {
		if ctx.Err() != nil {
			return stopped, nil
		}
		select {
		case <-victim.done:
			continue // another fault got it first: not this roll's to stop
		default:
		}
		fresh, err := e.start(role, extra())
		if err != nil {
			return stopped, err
		}
		// Up: its heartbeat row is there. A replacement can also die at
		// start (another fault cut its database sessions): then this roll
		// ends, and the next one starts over.
		exited := false
		if err := wait.For(ctx, func() bool {
			select {
			case <-fresh.done:
				exited = true
				return true
			default:
			}
			var n int
			_ = pool.QueryRow(ctx, `SELECT count(*) FROM ferry_instances WHERE pid = $1`, fresh.cmd.Process.Pid).Scan(&n)
			return n > 0
		}); err != nil {
			if ctx.Err() != nil {
				return stopped, nil
			}
			return stopped, fmt.Errorf("the replacement %s did not come up: %w", role, err)
		}
		if exited {
			return stopped, fmt.Errorf("the replacement %s exited at start (%v)", role, fresh.cmd.ProcessState)
		}
		_ = victim.cmd.Process.Signal(sig)
		select {
		case <-victim.done:
		case <-time.After(stopWait):
			_ = victim.cmd.Process.Kill()
			<-victim.done
			return stopped + 1, fmt.Errorf("%w: a %s did not stop within %s of %s (killed; its log is in %s)", errHungStop, role, stopWait, sig, e.logDir)
		}
		stopped++
	}
	return stopped, nil
}

// errHungStop is a graceful stop that did not end: a drain that hangs. It
// fails the run (a violation), where a fault that could not be injected
// is only reported.
var errHungStop = errors.New("a graceful stop hung")

func (e *chaosEnv) stopAll() {
	e.mu.Lock()
	children := append([]*child(nil), e.children...)
	e.mu.Unlock()
	for _, c := range children {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, c := range children {
		select {
		case <-c.done:
		case <-time.After(20 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}
}

func rabbitmqctl(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "rabbitmqctl", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// servers are the run's own database and broker, when its faults need
// them: a database to refuse connections (outage) or to fail over, and a
// RabbitMQ cluster to lose a node of.
type servers struct {
	// outage makes the run's own database refuse connections (allow
	// false) or take them again; nil without DatabaseOutage.
	outage func(ctx context.Context, allow bool) error
	// failover halts the HA run's primary and promotes its standby.
	failover    func(ctx context.Context) error
	brokerNodes []*pipelinetest.RabbitNode
}

// startServers is the first phase: the servers of the run's own, cfg
// pointed at them; cl stops them when the run ends.
func startServers(ctx context.Context, cfg *app.Config, run ChaosRun, cl *cleanups) (servers, error) {
	var srv servers

	if run.DatabaseOutage > 0 {
		// Refusing connections is a property of a whole database: the run
		// takes a server of its own, so the shared one is never touched.
		pg, err := startOwnPostgres(ctx)
		if err != nil {
			return srv, err
		}
		cl.add(func() { _ = pg.Stop() })
		cfg.DatabaseURL = pg.URL(chaosDatabase)
		srv.outage = func(ctx context.Context, allow bool) error {
			if err := pg.Exec(ctx, "postgres", fmt.Sprintf("ALTER DATABASE %s ALLOW_CONNECTIONS %t", chaosDatabase, allow)); err != nil || allow {
				return err
			}
			return pg.Exec(ctx, "postgres", `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, chaosDatabase)
		}
	}

	// The HA run's clusters, and its two faults.
	if run.HA {
		pg, err := startOwnPostgres(ctx)
		if err != nil {
			return srv, err
		}
		cl.add(func() { _ = pg.Stop() })
		standby, err := pg.StartStandby(ctx, true)
		if err != nil {
			return srv, fmt.Errorf("starting the run's standby: %w", err)
		}
		cl.add(func() { _ = standby.Stop() })
		cfg.DatabaseURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
			pg.Port, standby.Port, chaosDatabase)
		srv.failover = func(ctx context.Context) error {
			if err := pg.Halt(); err != nil {
				return err
			}
			return standby.Promote(ctx)
		}
		if srv.brokerNodes, err = pipelinetest.StartRabbitCluster(ctx, 3); err != nil {
			return srv, fmt.Errorf("starting the run's RabbitMQ cluster: %w", err)
		}
		cl.add(func() {
			for _, n := range srv.brokerNodes {
				_ = n.Close()
			}
		})
		urls := make([]string, len(srv.brokerNodes))
		for i, n := range srv.brokerNodes {
			urls[i] = n.Config.URL
		}
		cfg.AMQP.URL = strings.Join(urls, ",")
	}
	return srv, nil
}

// cleanups are what a run undoes when it ends, in reverse order (as
// defers would, across the phases).
type cleanups []func()

func (c *cleanups) add(f func()) { *c = append(*c, f) }

func (c *cleanups) run() {
	for i := len(*c) - 1; i >= 0; i-- {
		(*c)[i]()
	}
}
