package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"golang.org/x/sync/errgroup"

	"github.com/ferry-dev/ferry/internal/periodic"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/tenancy"
)

// APIAddr is the address the HTTP API listens on once Run has bound it
// ("" before, or without one): with FERRY_HTTP_ADDR at port 0, the port
// the system chose.
func (a *App) APIAddr() string { return a.addr("HTTP API") }

// AdminAddr is the admin server's bound address, as APIAddr.
func (a *App) AdminAddr() string { return a.addr("admin") }

func (a *App) addr(name string) string {
	v, _ := a.addrs.Load(name)
	s, _ := v.(string)
	return s
}

// Components selects what Run runs.
type Components struct {
	Relay     bool
	Consumers bool
	HTTP      bool
	// Pruner prunes the outbox and the ledger every Retention.Interval.
	Pruner bool
}

// All runs every component in one process.
var All = Components{Relay: true, Consumers: true, HTTP: true, Pruner: true}

// Run runs the selected components until ctx is done or one fails.
// ready, if not nil, is closed once the consumers (if any) are consuming and
// the HTTP API (if any) is listening.
//
// Everything that can fail at start (binding the admin and API ports,
// building the router and the HTTP API, registering the heartbeat) is done
// before anything runs: a failed start leaves no heartbeat row behind and
// no goroutine working on a pool that is being closed.
func (a *App) Run(ctx context.Context, what Components, ready chan<- struct{}) (err error) {
	if a.opts.WithoutBroker && (what.Relay || what.Consumers) {
		return errors.New("an app built WithoutBroker runs neither relay nor consumers")
	}
	if what == (Components{HTTP: true}) && a.opts.HTTP == nil && a.tools == nil {
		return errors.New("this application has no HTTP API and no agent tools to serve (Options.HTTP, Options.Tools)")
	}
	var (
		servers []*server
		router  *message.Router
		conn    io.Closer
	)
	defer func() {
		if err != nil {
			for _, s := range servers {
				_ = s.ln.Close()
			}
			if conn != nil {
				_ = conn.Close()
			}
		}
	}()
	if a.cfg.AdminAddr != "off" {
		s, err := a.listen("admin", a.cfg.AdminAddr, a.AdminHandler())
		if err != nil {
			return err
		}
		servers = append(servers, s)
		if !s.loopback() {
			a.logger.Warn("the admin server listens beyond loopback: /metrics and /readyz answer anyone who can reach it; firewall it or keep FERRY_ADMIN_ADDR on 127.0.0.1",
				"addr", s.ln.Addr().String())
		}
	}
	if what.HTTP && (a.opts.HTTP != nil || a.tools != nil) {
		h, err := a.APIHandler()
		if err != nil {
			return err
		}
		s, err := a.listen("HTTP API", a.cfg.HTTPAddr, h)
		if err != nil {
			return err
		}
		servers = append(servers, s)
		if a.tools != nil && a.cfg.MCPToken == "" && !s.loopback() {
			a.logger.Warn("the agent tool endpoints /mcp and /tools listen beyond loopback without a token: set FERRY_MCP_TOKEN",
				"addr", s.ln.Addr().String())
		}
	}
	if what.Consumers {
		if router, conn, err = a.NewRouter(); err != nil {
			return err
		}
	}
	if what.Relay && a.cdc != nil {
		// A server that cannot stream (wal_level, version, no table) fails
		// the start; an outage later is waited out by the streamer.
		if err := a.cdc.Prepare(ctx); err != nil {
			return fmt.Errorf("CDC relay: %w", err)
		}
		a.metrics.CDCSlot = a.cdc.Slot()
	}
	var hb *pgstatus.Heartbeat
	if what.Relay || what.Consumers {
		id := watermill.NewShortUUID()
		if err := waitOutOutage(ctx, func() (err error) {
			hb, err = pgstatus.NewHeartbeat(ctx, a.pool, id, a.componentNames(what), a.version())
			return err
		}); err != nil {
			return err
		}
	}
	if what.Consumers {
		// The route table, for the tools that run without it: ferry find
		// tells which pause or held partition a message waits behind.
		if err := waitOutOutage(ctx, func() error { return pgstatus.RegisterRoutes(ctx, a.pool, a.routeRegistry()) }); err != nil {
			return err
		}
	}

	g, ctx := errgroup.WithContext(ctx)
	var waits []<-chan struct{}
	if a.waker != nil {
		g.Go(func() error { return a.waker.Run(ctx) })
	}
	// The background services, from one list (internal/periodic).
	services := []periodic.Service{a.metrics.Refresher(a.pool, a.cfg.MetricsRefresh)}
	if hb != nil {
		hb.Counters = a.metrics.Counters
		services = append(services, hb.Service(pgstatus.DefaultHeartbeatInterval))
	}
	if what.Pruner {
		services = append(services, a.pruner())
	}
	if what.Consumers && a.parking != nil {
		services = append(services, a.parking.Service())
	}
	g.Go(func() error { periodic.Start(ctx, a.logger, services...)(); return nil })
	if what.Relay {
		g.Go(func() error { return a.relay.Run(ctx) })
		if a.cdc != nil {
			g.Go(func() error { return a.cdc.Run(ctx) })
		}
	}
	if a.fleet != nil {
		switch {
		case what.Relay:
			// The tenants are shared among the processes whose
			// heartbeat names the fleet's component: this one's id.
			a.fleet.SetMember(hb.ID())
			g.Go(func() error { return a.fleet.Run(ctx) })
		case what.Consumers:
			g.Go(func() error { return a.fleet.Follow(ctx) })
		}
	}
	for _, s := range servers {
		s.run(ctx, g, a.cfg.ShutdownTimeout)
		a.addrs.Store(s.name, s.ln.Addr().String())
		a.logger.Info(s.name+" listening", "addr", s.ln.Addr().String())
	}
	if router != nil {
		waits = append(waits, router.Running())
		g.Go(func() error {
			defer conn.Close()
			if err := router.Run(ctx); err != nil {
				return fmt.Errorf("consumer router: %w", err)
			}
			return nil
		})
		consumers := 0 // router.Handlers() races with the running router
		for _, r := range a.routes {
			consumers += len(a.subscriptions(r))
		}
		g.Go(func() error {
			select {
			case <-router.Running():
				a.logger.Info("consumers started", "routes", len(a.routes), "consumers", consumers)
			case <-ctx.Done():
			}
			return nil
		})
	}
	if ready != nil {
		go func() {
			for _, w := range waits {
				select {
				case <-w:
				case <-ctx.Done():
					return
				}
			}
			close(ready)
		}()
	}
	return g.Wait()
}

func (a *App) version() string {
	if a.opts.Version != "" {
		return a.opts.Version
	}
	return "dev"
}

// TenantConnections counts, in a tenant fleet (FERRY_TENANTS), the
// tenants' open pools, the connections they hold and the LISTEN
// connections (one per database); zeros otherwise.
func (a *App) TenantConnections() (pools, conns, listeners int) {
	if a.fleet == nil {
		return 0, 0, 0
	}
	return a.fleet.Connections()
}

// componentNames are what the heartbeat says this process runs: a tenant
// fleet's relay names the fleet's component too (its members share the
// tenants).
func (a *App) componentNames(what Components) []string {
	n := what.names()
	if a.fleet != nil && what.Relay {
		n = append(n, tenancy.Component)
	}
	return n
}

func (c Components) names() []string {
	var n []string
	for _, x := range []struct {
		on   bool
		name string
	}{{c.Relay, "relay"}, {c.Consumers, "consumers"}, {c.HTTP, "http"}, {c.Pruner, "pruner"}} {
		if x.on {
			n = append(n, x.name)
		}
	}
	return n
}

// Start runs the selected components in the background and returns once
// they are ready (see Run). stop ends them and returns Run's error; it may
// be called more than once, so it can be deferred and called early.
func (a *App) Start(ctx context.Context, what Components) (stop func() error, err error) {
	runCtx, cancel := context.WithCancel(ctx)
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- a.Run(runCtx, what, ready) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	select {
	case <-ready:
		return stop, nil
	case err := <-done:
		once.Do(func() { cancel(); runErr = err })
		return nil, err
	case <-ctx.Done():
		_ = stop()
		return nil, ctx.Err()
	}
}

// Close releases every connection. It is safe after a failed New.
func (a *App) Close() error {
	var errs []error
	if a.waker != nil {
		a.waker.Close()
	}
	if a.batchPublisher != nil {
		errs = append(errs, a.batchPublisher.Close())
	}
	if a.publisher != nil {
		errs = append(errs, a.publisher.Close())
	}
	if a.pubConn != nil {
		errs = append(errs, a.pubConn.Close())
	}
	if a.fleet != nil {
		a.fleet.Pools().Close()
	}
	if a.db != nil {
		errs = append(errs, a.db.Close())
	}
	if a.pool != nil {
		a.pool.Close()
	}
	if a.shutdownTracing != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs = append(errs, a.shutdownTracing(ctx))
		cancel()
	}
	return errors.Join(errs...)
}
