package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"syscall"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
)

// The fault phases of a run: what each fault does, when, and how it is
// stopped and waited out.

// faultPhase is the faults injected while the driver places orders: the
// rolling restarts, the fault loop, the database outage and the HA faults,
// each in a goroutine of its own.
type faultPhase struct {
	run ChaosRun
	rep *ChaosReport
	// gate keeps the driver's own database work and the database outage
	// (or failover) apart.
	gate   sync.RWMutex
	ctx    context.Context // ends the faults
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	err    error // what could not be injected: reported, not fatal
	// hung are the graceful stops that did not end (errHungStop): each is
	// a violation of the run.
	hung []string
	// outageDone and haDone close when the outage and the HA faults,
	// which happen once each, are over.
	outageDone, haDone chan struct{}
	// windows are the network faults' spans, in rep.Network's order.
	windows [][2]time.Time
}

// startFaults is the fourth phase: every fault of the run, started in the
// background until finish or stop. childFaults gives a restarted child its
// handler-fault seed.
func startFaults(ctx context.Context, run ChaosRun, env *chaosEnv, driver *app.App, provider *sandbox.PaymentProvider, srv servers,
	vhost, appName string, childFaults func() string, rep *ChaosReport) *faultPhase {
	f := &faultPhase{run: run, rep: rep}
	f.ctx, f.cancel = context.WithCancel(ctx)
	faultCtx := f.ctx
	outage, failover, brokerNodes := srv.outage, srv.failover, srv.brokerNodes
	// recordFault records how a fault went: its error (what failed) joins
	// the run's, which are reported, not fatal; or it counts as one more
	// of kind, and done, if any, notes what it did, under the same lock.
	recordFault := func(kind, what string, err error, done func()) {
		f.mu.Lock()
		defer f.mu.Unlock()
		if errors.Is(err, errHungStop) {
			f.hung = append(f.hung, fmt.Sprintf("%s: %v", what, err))
		}
		if err != nil {
			f.err = errors.Join(f.err, fmt.Errorf("%s: %w", what, err))
			return
		}
		rep.Faults[kind]++
		if done != nil {
			done()
		}
	}
	// rollConsumers restarts the consumers one by one with sig, first
	// failing the next charges so that partitions are held and retries in
	// flight when the processes stop.
	rollConsumers := func(kind string, sig syscall.Signal) {
		provider.FailNext(12)
		n, err := env.roll(faultCtx, driver.Pool(), "consume", sig, consumerStopWait, childFaults)
		if faultCtx.Err() != nil {
			if n == 0 {
				return // cut short before it stopped anything: not a fault injected
			}
			err = nil // cut short by the run's end: what it stopped counts
		}
		recordFault(kind, kind, err, func() { rep.ConsumerStops += n })
	}
	// The rolls run beside the other faults, one after another: a roll
	// takes seconds (each replacement must come up first) and would hold
	// the other faults back.
	kind, sig := "rolling_restart", syscall.SIGTERM
	if run.Restarts != "" {
		kind, sig = "rolling_restart_"+run.Restarts, map[string]syscall.Signal{"sigterm": syscall.SIGTERM, "sigkill": syscall.SIGKILL}[run.Restarts]
	}
	if run.Network {
		// The network plan is the run's only fault; finish waits for it
		// (haDone), as for the HA faults.
		f.outageDone, f.haDone = make(chan struct{}), make(chan struct{})
		close(f.outageDone)
		start := time.Now()
		f.wg.Go(func() {
			f.runNetworkFaults(env.network, networkPlan(run), start, sessionsOpen(driver.Pool()), f.haDone)
		})
		return f
	}
	if run.Versions {
		// The version roll: the consumers to version 2 at a fifth of the
		// orders (the producers follow at two fifths), to version 3 at four
		// fifths, after the producers went ahead at three (placeOrders):
		// both orders a deploy can take. Each roll starts the new code
		// before it stops the old.
		// finish waits for both rolls (haDone), as for the HA faults.
		f.outageDone, f.haDone = make(chan struct{}), make(chan struct{})
		close(f.outageDone)
		f.wg.Go(func() {
			defer close(f.haDone)
			for _, step := range []struct {
				at      int64
				version string
			}{{int64(run.Orders) / 5, "2"}, {int64(run.Orders) * 4 / 5, "3"}} {
				for env.placed.Load() < step.at {
					select {
					case <-faultCtx.Done():
						return
					case <-time.After(10 * time.Millisecond):
					}
				}
				env.version.Store(step.version)
				n, err := env.roll(context.WithoutCancel(faultCtx), driver.Pool(), "consume", syscall.SIGTERM, consumerStopWait, childFaults)
				recordFault("version_consumers_v"+step.version, "rolling the consumers to version "+step.version, err, func() { rep.ConsumerStops += n })
			}
		})
		return f
	}
	f.wg.Go(func() {
		for {
			select {
			case <-faultCtx.Done():
				return
			case <-time.After(run.FaultEvery):
			}
			rollConsumers(kind, sig)
		}
	})
	f.wg.Go(func() {
		if run.Restarts != "" {
			return
		}
		frng := rand.New(rand.NewPCG(run.Seed^0xfa17, run.Seed))
		kinds := []string{"kill_relay", "kill_consumer", "terminate_db_backends", "close_amqp_connections", "provider_non_utf8"}
		if env.links != nil {
			kinds = append(kinds, "network_black_hole", "network_resets")
		}
		inFlight := sessionsOpen(driver.Pool())
		for n := 1; ; n++ {
			select {
			case <-faultCtx.Done():
				return
			case <-time.After(run.FaultEvery):
			}
			// Each round of len(kinds) faults has every kind once, in a
			// seeded order: a short run meets each of them, a long one
			// stays unpredictable.
			if (n-1)%len(kinds) == 0 {
				frng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
			}
			kind := kinds[(n-1)%len(kinds)]
			// A broker restart takes seconds and stops everything: every
			// tenth fault at most, so the others still come thick and fast.
			if run.RestartBroker && n%10 == 0 {
				kind = "restart_broker"
			}
			var err error
			// hit is whether the fault met anything: a kill with no live
			// process, or a termination that matched no backend, injected
			// nothing and is not counted.
			hit := true
			switch kind {
			case "kill_relay":
				hit, err = env.killAndRestart(frng, "relay", childFaults())
			case "kill_consumer":
				hit, err = env.killAndRestart(frng, "consume", childFaults())
			case "terminate_db_backends":
				f.gate.RLock()
				var n int
				// The children's sessions: appName, or appName-<role>-<n>
				// for a child behind proxies of its own (not the driver's).
				err = driver.Pool().QueryRow(faultCtx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
					WHERE application_name = $1 OR application_name LIKE $1 || '-relay-%' OR application_name LIKE $1 || '-consume-%'`, appName).Scan(&n)
				f.gate.RUnlock()
				hit = n > 0
			case "close_amqp_connections":
				if run.HA {
					// Cluster-wide, through a node the node-loss fault
					// leaves alone (a rabbitmqctl call takes a second or two).
					err = brokerNodes[1].Run("close_all_connections", "--global", "--vhost", "/", "ferry chaos")
				} else {
					err = rabbitmqctl(faultCtx, "close_all_connections", "--vhost", vhost, "ferry chaos")
				}
			case "network_black_hole", "network_resets":
				// One child's link, beside the other faults (a black hole
				// lasts 3 s): counted once it is over, and only if it met
				// the child with a transaction open.
				live := append(env.live("relay"), env.live("consume")...)
				if len(live) == 0 {
					hit = false
					break
				}
				c, link := live[frng.IntN(len(live))], []string{"db", "broker"}[frng.IntN(2)]
				f.wg.Go(func() {
					met, err := mixFault(faultCtx, kind, link, c, inFlight)
					select {
					case <-c.done:
						err = nil // killed meanwhile: its proxies went with it
					default:
					}
					f.mu.Lock()
					defer f.mu.Unlock()
					switch {
					case faultCtx.Err() != nil || err == nil && !met:
						rep.FaultsMissed[kind]++
					case err != nil:
						f.err = errors.Join(f.err, fmt.Errorf("%s: %w", kind, err))
					default:
						rep.Faults[kind]++
						rep.FaultsMetWork[kind]++
					}
				})
				continue
			case "provider_non_utf8":
				// The next charges are answered 503 in Latin-1 with a NUL.
				provider.FailNextWithGarbage(3, providerGarbage)
			case "restart_broker":
				// Both halves run to the end even when the run ends
				// meanwhile: a stop_app cut short still stops the node's
				// app, and a broker left stopped would fail the drain and
				// every later run on this machine.
				if err = rabbitmqctl(context.WithoutCancel(faultCtx), "stop_app"); err == nil {
					err = rabbitmqctl(context.WithoutCancel(faultCtx), "start_app")
				}
			}
			if faultCtx.Err() != nil {
				// Cut short by the run's end: neither an error nor a fault
				// injected.
				f.mu.Lock()
				rep.FaultsMissed[kind]++
				f.mu.Unlock()
				return
			}
			if !hit && err == nil {
				f.mu.Lock()
				rep.FaultsMissed[kind]++
				f.mu.Unlock()
				continue
			}
			recordFault(kind, kind, err, nil)
		}
	})

	// The database outage, once, a third of the way through the orders:
	// the driver (the application) stands still while its database is
	// gone; relays and consumers keep trying, and must poison nothing.
	f.outageDone = make(chan struct{})
	if outage == nil {
		close(f.outageDone)
	} else {
		f.wg.Go(func() {
			defer close(f.outageDone)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Duration(run.Orders/3) * time.Second / time.Duration(run.Rate)):
			}
			// Under load: a slow provider first, so that charges wait in
			// the broker when the database goes, and consumers meet the
			// outage mid-message. The outage starts once enough wait,
			// however fast the driver places orders on this machine.
			provider.SetDelay(300 * time.Millisecond)
			defer provider.SetDelay(0)
			provider.FailNextWithGarbage(5, providerGarbage)
			recordFault("provider_non_utf8", "", nil, nil)
			backlog := 0
			for wait := time.Now().Add(30 * time.Second); time.Now().Before(wait) && backlog < outageBacklog; {
				select {
				case <-ctx.Done():
					return
				case <-time.After(100 * time.Millisecond):
				}
				var placed int
				_ = driver.Pool().QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&placed)
				backlog = placed - provider.Requests()
			}
			f.gate.Lock()
			defer f.gate.Unlock()
			began := time.Now()
			err := outage(ctx, false)
			if err == nil {
				select {
				case <-ctx.Done():
				case <-time.After(run.DatabaseOutage):
				}
				err = outage(context.WithoutCancel(ctx), true)
			}
			recordFault("database_refuses_connections", "database outage", err, func() {
				rep.DatabaseOutageSeconds = time.Since(began).Seconds()
				rep.ChargesWaitingAtOutage = backlog
			})
		})
	}

	// The HA faults, once each while orders are placed: at a fifth, the
	// broker node the pipeline's connections are on (the first that
	// answers: the first) stops for 5 s; at half, the database fails over,
	// the driver standing still meanwhile (its retries cover the commits
	// the crash cuts).
	f.haDone = make(chan struct{})
	if !run.HA {
		close(f.haDone)
	} else {
		orderTime := time.Duration(run.Orders) * time.Second / time.Duration(run.Rate)
		at := func(frac float64) <-chan time.Time { return time.After(time.Duration(float64(orderTime) * frac)) }
		var ha sync.WaitGroup
		ha.Go(func() {
			select {
			case <-ctx.Done():
				return
			case <-at(0.2):
			}
			node := brokerNodes[0]
			began := time.Now()
			err := node.Run("stop_app")
			if err == nil {
				time.Sleep(5 * time.Second)
				err = node.Run("start_app")
			}
			recordFault("broker_node_lost", "broker node loss", err, func() {
				rep.BrokerNodeLostSeconds = time.Since(began).Seconds()
			})
		})
		ha.Go(func() {
			select {
			case <-ctx.Done():
				return
			case <-at(0.5):
			}
			f.gate.Lock()
			began := time.Now()
			err := failover(context.WithoutCancel(ctx))
			f.gate.Unlock()
			recordFault("database_failover", "database failover", err, func() {
				rep.FailoverSeconds = time.Since(began).Seconds()
			})
		})
		f.wg.Go(func() { ha.Wait(); close(f.haDone) })
	}
	return f
}

// retried runs fn beside the outage (the gate's read lock). In an HA run a
// failure is tried again, 100 ms apart, up to 100 times: after a failover
// the driver's connections to the old primary are gone, and its first
// tries fail. Each retry counts in *retries, if not nil.
func (f *faultPhase) retried(fn func() error, retries *int) error {
	f.gate.RLock()
	err := fn()
	f.gate.RUnlock()
	for try := 0; err != nil && f.run.HA && try < 100 && f.ctx.Err() == nil; try++ {
		if retries != nil {
			*retries++
		}
		time.Sleep(100 * time.Millisecond)
		f.gate.RLock()
		err = fn()
		f.gate.RUnlock()
	}
	return err
}

// finish waits for the faults that happen once (the outage happens while
// orders wait, even if the driver placed its last one first), then stops
// the others; it returns what could not be injected.
func (f *faultPhase) finish(ctx context.Context) error {
	select {
	case <-f.outageDone:
	case <-ctx.Done():
	}
	select {
	case <-f.haDone:
	case <-ctx.Done():
	}
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline) && ctx.Err() == nil; {
		f.mu.Lock()
		stops := f.rep.ConsumerStops
		f.mu.Unlock()
		if stops >= f.run.MinConsumerStops {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	f.stop()
	f.mu.Lock()
	f.rep.Violations = append(f.rep.Violations, f.hung...)
	f.mu.Unlock()
	return f.err
}

// stop ends every fault and waits for their goroutines.
func (f *faultPhase) stop() {
	f.cancel()
	f.wg.Wait()
}
