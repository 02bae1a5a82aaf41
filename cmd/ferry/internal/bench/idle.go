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
// written, its own CPU and PostgreSQL's sampled from /proc over
// --duration (after a warm-up), in milliseconds of CPU per second.
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
	srv0, pg0, t0 := readServerCPU(), pidsCPU(backends), time.Now()
	select {
	case <-ctx.Done():
		return benchReport{}, ctx.Err()
	case <-time.After(bc.Duration):
	}
	srv1, pg1, elapsed := readServerCPU(), pidsCPU(backends), time.Since(t0).Seconds()
	probes := float64(a.Stats().Relay.Probes-probes0) / elapsed
	// Jiffies are 10 ms.
	perSecond := func(jiffies uint64) float64 { return math.Round(10*float64(jiffies)*10/elapsed) / 10 }
	self, pg := perSecond(srv1.self-srv0.self), perSecond(pg1-pg0)
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

// pidsCPU is the CPU time (user + system, jiffies) of these processes.
func pidsCPU(pids []int) uint64 {
	var sum uint64
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			continue
		}
		end := strings.LastIndexByte(string(b), ')')
		if end < 0 {
			continue
		}
		fields := strings.Fields(string(b[end+1:]))
		if len(fields) < 13 {
			continue
		}
		utime, _ := strconv.ParseUint(fields[11], 10, 64)
		stime, _ := strconv.ParseUint(fields[12], 10, 64)
		sum += utime + stime
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
