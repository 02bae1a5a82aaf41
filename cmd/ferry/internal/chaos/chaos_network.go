package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	toxiclient "github.com/Shopify/toxiproxy/v2/client"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The network run (--network): faults the network makes, from Toxiproxy.
// Two `ferry run` processes, A and B (relay, consumers and API each), share
// one schema and one vhost; each reaches PostgreSQL and RabbitMQ through
// proxies of its own, so a fault strikes one process's link while the
// other stays healthy. The fleet's promise under such a fault: nothing
// lost, doubled, reordered or poisoned, and the orders committed while it
// lasts charged within NetworkBound (p99) of their commit: the healthy
// process does the work the sick one cannot.

// NetworkBound is the most a fault on one process's link may delay the
// fleet's effects (p99, commit → charge): docs/reliability.md states it.
const NetworkBound = 15 * time.Second

// networkProcesses are the run's `ferry run` processes.
var networkProcesses = []string{"A", "B"}

// NetworkFault is one fault of a network run, as the report shows it.
type NetworkFault struct {
	Kind    string `json:"kind"`
	Process string `json:"process"`
	// At is when it began, from the first order; Seconds how long it lasted.
	At      float64 `json:"at_seconds"`
	Seconds float64 `json:"seconds"`
	// MetWork is true when the fault met the sick process with work in
	// flight: a transaction of its open at the database (a batch waiting
	// for the broker's confirms, a handler's ledger transaction) in one of
	// the samples taken every 100 ms while the fault lasted, or, in its log
	// during the fault, a channel lost with deliveries unsettled
	// (rabbit.LostUnsettled), a relay batch the broker confirmed none of,
	// or a handler's message waiting out its link. A fault that met an
	// idle process proves nothing.
	MetWork bool `json:"met_work"`
	// Bounded is true for the faults the bound applies to (black holes
	// and resets: the sick process must step aside); latency, slow closes
	// and bandwidth only slow the sick process down, and are held to the
	// other invariants.
	Bounded bool `json:"bounded"`
	// Orders committed while it lasted, and their commit → charge delays.
	Orders int     `json:"orders"`
	P50    float64 `json:"p50_seconds"`
	P99    float64 `json:"p99_seconds"`
	Max    float64 `json:"max_seconds"`
}

// netFault is one fault to inject: toxics on one process's link.
type netFault struct {
	kind    string
	process int
	link    string // "db" or "broker"
	dur     time.Duration
	toxics  []toxic
	bounded bool
}

type toxic struct {
	typ, stream string
	attrs       toxiclient.Attributes
}

// blackHole drops every byte both ways and keeps the connections open, as
// a security group change, a dead NAT entry or a paused VM does.
var blackHole = []toxic{
	{"timeout", "upstream", toxiclient.Attributes{"timeout": 0}},
	{"timeout", "downstream", toxiclient.Attributes{"timeout": 0}},
}

// The kinds of network fault, by name.
func faultOf(kind string, process int, dur time.Duration) netFault {
	f := netFault{kind: kind, process: process, dur: dur}
	switch kind {
	case "broker_black_hole":
		f.link, f.toxics, f.bounded = "broker", blackHole, true
	case "db_black_hole":
		f.link, f.toxics, f.bounded = "db", blackHole, true
	case "db_latency":
		// 300 ± 200 ms on every answer of the database.
		f.link, f.toxics = "db", []toxic{{"latency", "downstream", toxiclient.Attributes{"latency": 300, "jitter": 200}}}
	case "broker_latency":
		f.link, f.toxics = "broker", []toxic{{"latency", "downstream", toxiclient.Attributes{"latency": 300, "jitter": 200}}}
	case "broker_resets":
		// Every connection, and every new one, reset by peer at once.
		f.link, f.toxics, f.bounded = "broker", []toxic{{"reset_peer", "upstream", toxiclient.Attributes{"timeout": 0}}}, true
	case "db_resets":
		f.link, f.toxics, f.bounded = "db", []toxic{{"reset_peer", "upstream", toxiclient.Attributes{"timeout": 0}}}, true
	case "db_slow_close":
		// A close takes 5 s to reach the other side (half-closed meanwhile),
		// with the answers slowed so that connections do close.
		f.link, f.toxics = "db", []toxic{{"slow_close", "downstream", toxiclient.Attributes{"delay": 5000}},
			{"latency", "downstream", toxiclient.Attributes{"latency": 100, "jitter": 50}}}
	case "broker_bandwidth":
		// 32 KB/s from the broker: deliveries trickle in.
		f.link, f.toxics = "broker", []toxic{{"bandwidth", "downstream", toxiclient.Attributes{"rate": 32}}}
	}
	return f
}

// networkKinds are every kind of network fault, the long run's mix.
var networkKinds = []string{"broker_black_hole", "db_black_hole", "db_latency", "broker_latency", "broker_resets", "db_resets", "db_slow_close", "broker_bandwidth"}

// networkGap is the healthy time between two faults, and before the first.
const networkGap = 5 * time.Second

// networkPlan is the run's faults in order. The short run, one fault at a
// time: a 45 s broker black hole on A; 300 ± 200 ms of database latency on
// B, which by then holds every ordered partition (A's consumers lost
// theirs with the connection and came back as standbys); a 20 s database
// black hole on B, which must hand those partitions over to A; 4 s of
// broker resets on A, which then holds them. The full plan adds the other
// kinds once each; the long run draws kinds and processes from the seed
// until it lasts NetworkDuration.
func networkPlan(run ChaosRun) []netFault {
	plan := []netFault{
		faultOf("broker_black_hole", 0, 45*time.Second),
		faultOf("db_latency", 1, 30*time.Second),
		faultOf("db_black_hole", 1, 20*time.Second),
		faultOf("broker_resets", 0, 4*time.Second),
	}
	if run.NetworkShort {
		return plan
	}
	plan = append(plan,
		faultOf("broker_latency", 0, 20*time.Second),
		faultOf("db_resets", 1, 4*time.Second),
		faultOf("db_slow_close", 0, 20*time.Second),
		faultOf("broker_bandwidth", 1, 20*time.Second),
	)
	if run.NetworkDuration <= 0 {
		return plan
	}
	rng := rand.New(rand.NewPCG(run.Seed^0x7e7, run.Seed))
	total := planDuration(plan)
	for total < run.NetworkDuration {
		kind := networkKinds[rng.IntN(len(networkKinds))]
		dur := time.Duration(5+rng.IntN(40)) * time.Second
		if kind == "broker_resets" || kind == "db_resets" {
			dur = time.Duration(2+rng.IntN(5)) * time.Second
		}
		f := faultOf(kind, rng.IntN(len(networkProcesses)), dur)
		plan = append(plan, f)
		total += f.dur + networkGap
	}
	return plan
}

// planDuration is how long plan takes, its gaps included.
func planDuration(plan []netFault) time.Duration {
	d := networkGap
	for _, f := range plan {
		d += f.dur + networkGap
	}
	return d
}

// inject makes f on c's link for its duration (or until ctx ends), then
// removes its toxics; it returns when the fault began and ended, and
// whether inFlight said yes of c's sessions in one of its samples
// meanwhile.
func (c *childLinks) inject(ctx context.Context, f netFault, inFlight func(ctx context.Context, appName string) bool) (began, ended time.Time, met bool, err error) {
	p := c.broker
	if f.link == "db" {
		p = c.db
	}
	var names []string
	defer func() {
		for _, name := range names {
			err = errors.Join(err, p.RemoveToxic(name))
		}
		ended = time.Now()
	}()
	// A sample just before: what a reset cuts at once was in flight then.
	met = inFlight(ctx, c.name)
	began = time.Now()
	for i, t := range f.toxics {
		name := fmt.Sprintf("%s-%d", f.kind, i)
		if _, err := p.AddToxic(name, t.typ, t.stream, 1, t.attrs); err != nil {
			return began, began, false, fmt.Errorf("adding %s to %s: %w", t.typ, p.Name, err)
		}
		names = append(names, name)
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for end := time.After(f.dur); ; {
		select {
		case <-ctx.Done():
			return began, ended, met, nil
		case <-end:
			return began, ended, met, nil
		case <-tick.C:
			met = met || inFlight(ctx, c.name)
		}
	}
}

// runNetworkFaults injects the plan, one fault at a time, networkGap
// apart, and records each into rep; done closes at the plan's end.
// procs are the network run's processes, in networkProcesses' order.
func (f *faultPhase) runNetworkFaults(procs []*child, plan []netFault, start time.Time, inFlight func(ctx context.Context, appName string) bool, done chan struct{}) {
	defer close(done)
	for _, nf := range plan {
		select {
		case <-f.ctx.Done():
			return
		case <-time.After(networkGap):
		}
		process := networkProcesses[nf.process]
		began, ended, met, err := procs[nf.process].links.inject(f.ctx, nf, inFlight)
		f.mu.Lock()
		if err != nil {
			f.err = errors.Join(f.err, fmt.Errorf("%s on %s: %w", nf.kind, process, err))
		} else {
			f.rep.Network = append(f.rep.Network, NetworkFault{Kind: nf.kind, Process: process, MetWork: met, Bounded: nf.bounded,
				At: began.Sub(start).Seconds(), Seconds: ended.Sub(began).Seconds()})
			f.windows = append(f.windows, [2]time.Time{began, ended})
		}
		f.mu.Unlock()
	}
}

// checkNetwork measures each fault's commit → charge delays of the orders
// committed while it lasted; a bounded fault's past NetworkBound (p99), a
// fault that met no work in flight, or a poisoned message is a violation.
func checkNetwork(rep *ChaosReport, windows [][2]time.Time, committedAt map[int64]time.Time, charges []sandbox.Charge, logDir string) {
	chargedAt := map[int64]time.Time{}
	for _, c := range charges {
		id, err := strconv.ParseInt(c.OrderID, 10, 64)
		if err == nil {
			chargedAt[id] = c.At
		}
	}
	rep.NetworkBoundSeconds = NetworkBound.Seconds()
	for i := range rep.Network {
		nf := &rep.Network[i]
		began, ended := windows[i][0], windows[i][1]
		var delays []float64
		for id, at := range committedAt {
			if at.Before(began) || at.After(ended) {
				continue
			}
			c, ok := chargedAt[id]
			if !ok {
				continue // lost or poisoned: the run's other checks count it
			}
			delays = append(delays, c.Sub(at).Seconds())
		}
		slices.Sort(delays)
		nf.Orders = len(delays)
		if len(delays) > 0 {
			nf.P50, nf.P99, nf.Max = quantile(delays, 0.50), quantile(delays, 0.99), delays[len(delays)-1]
		}
		nf.MetWork = nf.MetWork || loggedWork(filepath.Join(logDir, nf.Process+".log"), began, ended.Add(time.Second))
		if nf.MetWork {
			rep.FaultsMetWork[nf.Kind]++
		}
		rep.Faults[nf.Kind]++
		switch {
		case nf.Orders == 0:
			rep.Violations = append(rep.Violations, fmt.Sprintf("%s on %s at +%.0fs: no order was committed and charged while it lasted: it measured nothing", nf.Kind, nf.Process, nf.At))
		case !nf.MetWork:
			rep.Violations = append(rep.Violations, fmt.Sprintf("%s on %s at +%.0fs: the process had no transaction open in any sample while it lasted: it met no work in flight", nf.Kind, nf.Process, nf.At))
		case nf.Bounded && nf.P99 > NetworkBound.Seconds():
			rep.Violations = append(rep.Violations, fmt.Sprintf("%s on %s at +%.0fs for %.0fs: the fleet's charges waited p99 %.1fs (max %.1fs) after their commit, past the %s bound",
				nf.Kind, nf.Process, nf.At, nf.Seconds, nf.P99, nf.Max, NetworkBound))
		}
	}
	if rep.Poisoned > 0 {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d message(s) poisoned by network faults (%v): an outage is waited out, never blamed on the message", rep.Poisoned, rep.PoisonReasons))
	}
}

// quantile is the q-quantile of sorted (nearest rank).
func quantile(sorted []float64, q float64) float64 {
	i := int(float64(len(sorted))*q+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// workLost are the log texts of work a fault met in flight: a channel
// lost with deliveries unsettled, a relay batch with rows in hand that
// the broker confirmed none of (not one the relay did not try), a
// handler's message waiting out its link.
var workLost = []string{rabbit.LostUnsettled, "the broker confirmed none of the batch", "infrastructure unavailable; waiting"}

// loggedWork reports whether the JSON log at path has, stamped within
// [from, to], a line saying that work in flight met a fault (workLost).
func loggedWork(path string, from, to time.Time) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 4<<20)
	for sc.Scan() {
		text := sc.Text()
		if !slices.ContainsFunc(workLost, func(w string) bool { return strings.Contains(text, w) }) || strings.Contains(text, "not tried") {
			continue
		}
		var line struct {
			Time time.Time `json:"time"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && !line.Time.Before(from) && !line.Time.After(to) {
			return true
		}
	}
	return false
}

// linkProxies puts each child behind two proxies of its own (PostgreSQL,
// RabbitMQ), made when it starts and removed when it exits, for the
// network faults: the network run's, and the default mix's (black holes
// and resets of one child's link, a few seconds each).
type linkProxies struct {
	tp             *pipelinetest.Toxiproxy
	dbURL, amqpURL string
	dbUp, brokerUp string
}

func newLinkProxies(dbURL, amqpURL string, cl *cleanups) (*linkProxies, error) {
	dbUp, err := pipelinetest.Upstream(dbURL)
	if err != nil {
		return nil, fmt.Errorf("the network faults need FERRY_DATABASE_URL with one host: %w", err)
	}
	brokerUp, err := pipelinetest.Upstream(amqpURL)
	if err != nil {
		return nil, fmt.Errorf("the network faults need FERRY_AMQP_URL with one host: %w", err)
	}
	tp, err := pipelinetest.StartToxiproxy()
	if err != nil {
		return nil, err
	}
	cl.add(func() { _ = tp.Close() })
	return &linkProxies{tp: tp, dbURL: dbURL, amqpURL: amqpURL, dbUp: dbUp, brokerUp: brokerUp}, nil
}

// childLinks are one child's proxies, its configuration through them and
// its application name.
type childLinks struct {
	name       string
	db, broker *toxiclient.Proxy
	env        []string
}

func (l *linkProxies) open(name string) (*childLinks, error) {
	db, err := l.tp.Proxy(name+"-postgres", l.dbUp)
	if err != nil {
		return nil, err
	}
	broker, err := l.tp.Proxy(name+"-rabbitmq", l.brokerUp)
	if err != nil {
		_ = db.Delete()
		return nil, err
	}
	c := &childLinks{name: name, db: db, broker: broker}
	d, err := pipelinetest.ThroughProxy(l.dbURL, db.Listen)
	if err == nil {
		var b string
		if b, err = pipelinetest.ThroughProxy(l.amqpURL, broker.Listen); err == nil {
			c.env = []string{"FERRY_DATABASE_URL=" + d, "FERRY_AMQP_URL=" + b, "FERRY_DATABASE_APP_NAME=" + name}
			return c, nil
		}
	}
	c.close()
	return nil, err
}

// close removes the child's proxies (nil: none).
func (c *childLinks) close() {
	if c == nil {
		return
	}
	_ = c.db.Delete()
	_ = c.broker.Delete()
}

// mixFault is one network fault of the default mix on child c's link
// ("db" or "broker"): a black hole for 3 s or resets for 1 s. It reports
// whether the fault met the child with a transaction open.
func mixFault(ctx context.Context, kind, link string, c *child, inFlight func(ctx context.Context, appName string) bool) (bool, error) {
	f := faultOf(map[string]string{"network_black_hole": link + "_black_hole", "network_resets": link + "_resets"}[kind], 0, 3*time.Second)
	if kind == "network_resets" {
		f.dur = time.Second
	}
	_, _, met, err := c.links.inject(ctx, f, inFlight)
	return met, err
}

// sessionsOpen returns whether a process (by its application name) has a
// transaction open at pool's server: a network fault that met none met no
// work in flight.
func sessionsOpen(pool *pgxpool.Pool) func(ctx context.Context, appName string) bool {
	return func(ctx context.Context, appName string) bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'`, appName).Scan(&n)
		return n > 0
	}
}
