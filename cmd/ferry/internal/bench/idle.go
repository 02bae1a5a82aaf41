package bench

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
)

// ScenarioIdleCost is what a Ferry process with nothing to do costs: the
// relay, the consumers and the app's periodic work running, no event
// written, its own CPU and its PostgreSQL backends' sampled from
// /proc/<pid>/task/*/schedstat over --duration (after a warm-up), in
// milliseconds of CPU per second.
const ScenarioIdleCost = "idle_cost"

func benchIdleCost(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	schema, drop, err := newAppSchema(ctx, cfg)
	if err != nil {
		return benchReport{}, err
	}
	defer drop()

	c := cfg
	c.DatabaseSchema = schema
	c.AdminAddr = "off"
	c.AMQP.Namespace = fmt.Sprintf("ferrybench%d.", time.Now().UnixNano())
	a, err := app.New(ctx, c, app.Options{Logger: logger, Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{
			{Name: "bench.idle", Topic: "bench.idle", Handler: func(*message.Message) error { return nil }},
			{Name: "bench.idle-ordered", Topic: "bench.idle-ordered", Ordered: true, Handler: func(*message.Message) error { return nil }},
		}, nil
	}})
	if err != nil {
		return benchReport{}, err
	}
	defer a.Close()
	defer func() { _ = a.Topology().Teardown(a.Broker()) }()
	stop, err := a.Start(ctx, app.Components{Relay: true, Consumers: true})
	if err != nil {
		return benchReport{}, err
	}
	defer stop()
	time.Sleep(3 * time.Second) // start-up's own work done
	backends, err := ownBackends(ctx, a.Pool(), serverPort(c.DatabaseURL))
	if err != nil {
		return benchReport{}, err
	}
	probes0 := a.Stats().Relay.Probes
	self0, pg0, t0 := onCPU(os.Getpid()), pidsCPU(backends), time.Now()
	select {
	case <-ctx.Done():
		return benchReport{}, ctx.Err()
	case <-time.After(bc.Duration):
	}
	self1, pg1, elapsed := onCPU(os.Getpid()), pidsCPU(backends), time.Since(t0).Seconds()
	probes := float64(a.Stats().Relay.Probes-probes0) / elapsed
	perSecond := func(ns uint64) float64 { return math.Round(10*float64(ns)/1e6/elapsed) / 10 }
	self, pg := perSecond(self1-self0), perSecond(pg1-pg0)
	js := map[string]any{"seconds": math.Round(elapsed*10) / 10, "process_ms_per_s": self, "postgresql_ms_per_s": pg, "backends": len(backends),
		"total_ms_per_s": math.Round((self+pg)*10) / 10, "relay_probes_per_s": math.Round(probes)}
	table := fmt.Sprintf("idle for %.0fs: this process %.1f ms/s, its %d PostgreSQL backends %.1f ms/s, total %.1f ms/s; relay probes %.0f/s\n",
		elapsed, self, len(backends), pg, self+pg, probes)
	return benchReport{JSON: js, Table: table}, nil
}

// ownBackends are the PostgreSQL backends serving this process's
// connections: the client ports of its TCP connections to the server
// (/proc/self/net/tcp and tcp6), matched in pg_stat_activity. Sampling
// only them keeps other clients of a shared server (a test suite, another
// service) out of Ferry's share.
func ownBackends(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, serverPort int) ([]int, error) {
	var ports []int
	for _, f := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fields := strings.Fields(line)
			if len(fields) < 4 || fields[3] != "01" { // ESTABLISHED
				continue
			}
			_, local, _ := strings.Cut(fields[1], ":")
			_, remote, _ := strings.Cut(fields[2], ":")
			lp, err1 := strconv.ParseUint(local, 16, 16)
			rp, err2 := strconv.ParseUint(remote, 16, 16)
			if err1 == nil && err2 == nil && int(rp) == serverPort {
				ports = append(ports, int(lp))
			}
		}
	}
	rows, err := q.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1)`, ports)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

// pidsCPU is the time these processes spent on a CPU, in nanoseconds.
func pidsCPU(pids []int) uint64 {
	var sum uint64
	for _, pid := range pids {
		sum += onCPU(pid)
	}
	return sum
}

// onCPU is the time process pid's threads spent on a CPU, in nanoseconds,
// from /proc/<pid>/task/*/schedstat: exact, where /proc/<pid>/stat's
// ticks of 10 ms charge a whole tick to whoever runs when it strikes, and
// overcharge a process that wakes briefly and often, as an idle one does.
func onCPU(pid int) uint64 {
	dir := "/proc/" + strconv.Itoa(pid) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var sum uint64
	for _, t := range tasks {
		b, err := os.ReadFile(dir + t.Name() + "/schedstat")
		if err != nil {
			continue // a thread gone since
		}
		f, _, _ := strings.Cut(string(b), " ")
		ns, _ := strconv.ParseUint(f, 10, 64)
		sum += ns
	}
	return sum
}

// serverPort is the port of the database URL (5432 unless it says).
func serverPort(dbURL string) int {
	if u, err := url.Parse(dbURL); err == nil {
		if p, err := strconv.Atoi(u.Port()); err == nil {
			return p
		}
	}
	return 5432
}
