package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// ScenarioMemory measures peak resident memory of relay and consumer
// processes of their own (children of this binary, see Child).
const ScenarioMemory = "memory"

// ChildEnv names the child a `ferry bench` process is asked to be: a
// relay or a consumer of the memory scenario (set by the parent only).
const ChildEnv = "FERRY_BENCH_CHILD"

// ChildProfileEnv is where a child writes its CPU profile (its kind and
// pid appended), when the parent runs with --cpuprofile.
const ChildProfileEnv = "FERRY_BENCH_CHILD_CPUPROFILE"

// batchConsumer is the child kind of a consumer whose route is a batch
// route (handlers.Batch, defaults) instead of a handler of one message.
const batchConsumer = "consume-batch"

const (
	memoryTopic = "bench.mem"
	memoryQueue = "bench.mem.sink"
)

// Child runs the memory scenario's child named by ChildEnv until ctx ends:
// a relay (pgoutbox.Relay over the batch publisher) or a consumer (the app's
// router with one route that only counts). Its configuration comes from
// the FERRY_* variables the parent set.
func Child(ctx context.Context, kind string, cfg app.Config, logger *slog.Logger) error {
	switch kind {
	case "relay":
		a, err := app.New(ctx, cfg, app.Options{Logger: logger, Routes: noRoutes})
		if err != nil {
			return err
		}
		defer a.Close()
		return a.Run(ctx, app.Components{Relay: true}, nil)
	case "consume", batchConsumer:
		var n atomic.Int64
		route := handlers.Route{Name: memoryQueue, Topic: memoryTopic, Handler: func(*message.Message) error { n.Add(1); return nil }}
		if kind == batchConsumer {
			route.Handler = nil
			route.Batch = &handlers.Batch{Handler: func(_ context.Context, msgs []*message.Message) error { n.Add(int64(len(msgs))); return nil }}
		}
		a, err := app.New(ctx, cfg, app.Options{Logger: logger, Routes: func(app.Deps) ([]handlers.Route, error) {
			return []handlers.Route{route}, nil
		}})
		if err != nil {
			return err
		}
		defer a.Close()
		return a.Run(ctx, app.Components{Consumers: true}, nil)
	}
	return fmt.Errorf("unknown bench child %q", kind)
}

func noRoutes(app.Deps) ([]handlers.Route, error) { return nil, nil }

// peakRSS reads a process's peak resident set (VmHWM) in bytes.
func peakRSS(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, errors.New("no VmHWM in /proc status")
}

type child struct {
	cmd *exec.Cmd
}

func startChild(binary, kind string, env []string) (*child, error) {
	if binary == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		binary = self
	}
	cmd := exec.Command(binary, "bench")
	cmd.Env = append(os.Environ(), append(env, ChildEnv+"="+kind, "FERRY_LOG_LEVEL=error")...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting a %s child: %w", kind, err)
	}
	return &child{cmd: cmd}, nil
}

func (c *child) stop() {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
	}
}

func benchMemory(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	relays := 4
	sch, err := newBenchSchema(ctx, cfg, 8)
	if err != nil {
		return benchReport{}, err
	}
	defer sch.drop()
	rc := cfg.AMQP
	rc.Namespace = fmt.Sprintf("ferrybench%d.", time.Now().UnixNano())
	topo, err := rabbit.NewTopology(rc)
	if err != nil {
		return benchReport{}, err
	}
	conn, err := rabbit.Dial(rc, "ferry-bench", watermill.NopLogger{})
	if err != nil {
		return benchReport{}, err
	}
	defer conn.Close()
	defer func() { _ = topo.Teardown(conn.Connection()) }()
	if err := topo.Declare(conn.Connection(), rabbit.Binding{Topic: memoryTopic, Queue: memoryQueue}); err != nil {
		return benchReport{}, err
	}
	if err := preload(ctx, sch.pool, memoryTopic, bc.Events); err != nil {
		return benchReport{}, err
	}
	env := []string{ChildProfileEnv + "=" + bc.CPUProfile, "FERRY_DATABASE_URL=" + cfg.DatabaseURL, "FERRY_DATABASE_SCHEMA=" + sch.name,
		"FERRY_AMQP_URL=" + cfg.AMQP.URL, "FERRY_AMQP_NAMESPACE=" + rc.Namespace, "FERRY_ADMIN_ADDR=off",
		"FERRY_RELAY_BATCH_SIZE=" + strconv.Itoa(bc.BatchSize), "FERRY_DATABASE_MAX_CONNS=" + strconv.Itoa(bc.ConsumerConns)}

	// Relays: four processes drain the outbox; each one's peak is read
	// before it is stopped.
	var kids []*child
	defer func() {
		for _, k := range kids {
			k.stop()
		}
	}()
	start := time.Now()
	for range relays {
		k, err := startChild(bc.Binary, "relay", env)
		if err != nil {
			return benchReport{}, err
		}
		kids = append(kids, k)
	}
	if err := waitFor(ctx, 5*time.Minute, func() (bool, error) {
		pending, err := pgoutbox.Table{}.PendingCount(ctx, sch.pool)
		return pending == 0, err
	}); err != nil {
		return benchReport{}, fmt.Errorf("relays: %w", err)
	}
	relaySecs := time.Since(start).Seconds()
	var relayPeaks []int64
	for _, k := range kids {
		p, err := peakRSS(k.cmd.Process.Pid)
		if err != nil {
			return benchReport{}, err
		}
		relayPeaks = append(relayPeaks, p)
	}
	// CPU per event: user and system time of the relay processes, which
	// did nothing but this (and wait) from start to stop. Less at the
	// mercy of a busy machine than events/s.
	var relayCPU time.Duration
	for _, k := range kids {
		k.stop()
		relayCPU += k.cmd.ProcessState.UserTime() + k.cmd.ProcessState.SystemTime()
	}
	kids = nil

	// A consumer: one process drains the queue the relays filled.
	cons, err := drainWithConsumer(ctx, sch, bc, env, bc.Events, "consume")
	if err != nil {
		return benchReport{}, err
	}
	consumeSecs, consumerPeak, consumerCPU := cons.seconds, cons.peakRSS, cons.cpu
	perEvent := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(bc.Events) }
	maxRelay := relayPeaks[0]
	for _, p := range relayPeaks {
		maxRelay = max(maxRelay, p)
	}
	mb := func(b int64) float64 { return float64(b) / (1 << 20) }
	var tb strings.Builder
	fmt.Fprintf(&tb, "peak RSS of one relay process (%d relay processes, %d events, %.1fs): %.1f MB (each:", relays, bc.Events, relaySecs, mb(maxRelay))
	for _, p := range relayPeaks {
		fmt.Fprintf(&tb, " %.1f", mb(p))
	}
	fmt.Fprintf(&tb, ")\npeak RSS of a consumer process draining %d messages (%.1fs, %.0f/s): %.1f MB\n", bc.Events, consumeSecs, float64(bc.Events)/consumeSecs, mb(consumerPeak))
	fmt.Fprintf(&tb, "CPU per event: relay processes %.1f µs (%.2fs in all), consumer %.1f µs (%.2fs)\n",
		perEvent(relayCPU), relayCPU.Seconds(), perEvent(consumerCPU), consumerCPU.Seconds())
	return benchReport{
		JSON: map[string]any{
			"params":                    map[string]any{"relay_processes": relays, "events": bc.Events, "batch_size": bc.BatchSize},
			"relay_peak_rss_bytes":      maxRelay,
			"relay_peak_rss_each":       relayPeaks,
			"relay_seconds":             relaySecs,
			"consumer_peak_rss_bytes":   consumerPeak,
			"consumer_seconds":          consumeSecs,
			"relay_cpu_us_per_event":    perEvent(relayCPU),
			"consumer_cpu_us_per_event": perEvent(consumerCPU),
		},
		Table: tb.String(),
	}, nil
}

// consumerRun is what one consumer child cost to drain its queue.
type consumerRun struct {
	seconds float64
	peakRSS int64
	cpu     time.Duration // user + system, start to stop
}

// drainWithConsumer starts a consumer child (the app's router, one route
// that only counts, the real ledger) and waits until it has processed n
// messages; its CPU and peak RSS are read when it has stopped.
func drainWithConsumer(ctx context.Context, sch *benchSchema, bc BenchConfig, env []string, n int, kind string) (consumerRun, error) {
	k, err := startChild(bc.Binary, kind, env)
	if err != nil {
		return consumerRun{}, err
	}
	defer k.stop()
	start := time.Now()
	if err := waitFor(ctx, 5*time.Minute, func() (bool, error) {
		var done int
		err := sch.pool.QueryRow(ctx, `SELECT count(*) FROM processed_messages`).Scan(&done)
		return done >= n, err
	}); err != nil {
		return consumerRun{}, fmt.Errorf("consumer: %w", err)
	}
	run := consumerRun{seconds: time.Since(start).Seconds()}
	if run.peakRSS, err = peakRSS(k.cmd.Process.Pid); err != nil {
		return consumerRun{}, err
	}
	k.stop()
	run.cpu = k.cmd.ProcessState.UserTime() + k.cmd.ProcessState.SystemTime()
	return run, nil
}

func waitFor(ctx context.Context, timeout time.Duration, done func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := done()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not done after %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
