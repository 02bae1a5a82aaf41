package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/sync/errgroup"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/agenttools/mcptools"
)

// APIHandler is what the API server serves: the application's HTTP API
// (Options.HTTP) and, with Options.Tools, the agent tools over MCP at /mcp
// (streamable HTTP) and as plain JSON at /tools (see agenttools.HTTPHandler).
// With FERRY_MCP_TOKEN set, every one of them needs it, the application's
// own routes too (when there are tools). The server Run starts also
// refuses unknown Host names (FERRY_HTTP_ALLOWED_HOSTS) and browsers'
// cross-site state-changing requests.
func (a *App) APIHandler() (http.Handler, error) {
	var app http.Handler
	if a.opts.HTTP != nil {
		h, err := a.opts.HTTP(a)
		if err != nil {
			return nil, fmt.Errorf("building the HTTP API: %w", err)
		}
		app = h
	}
	if a.tools == nil {
		if app == nil {
			return nil, errors.New("app: no HTTP API and no tools to serve")
		}
		return app, nil
	}
	mcpHandler, err := mcptools.HTTPHandler(a.tools, mcptools.HTTPOptions{Token: a.cfg.MCPToken, Logger: a.logger,
		SessionTimeout: a.cfg.MCPSessionTimeout, MaxSessions: a.cfg.MCPMaxSessions,
		Implementation: &mcp.Implementation{Name: "ferry", Version: a.version()}})
	if err != nil {
		return nil, fmt.Errorf("FERRY_MCP_TOKEN: %w", err)
	}
	var plain http.Handler = agenttools.HTTPHandler(a.tools, a.logger)
	open := app // the application's health checks: never behind the token
	if a.cfg.MCPToken != "" {
		// The application's routes follow the tools' rule: a plain POST
		// places the same order an agent's tool call does.
		plain = a.bearer(a.cfg.MCPToken, "FERRY_MCP_TOKEN", plain)
		if app != nil {
			app = a.bearer(a.cfg.MCPToken, "FERRY_MCP_TOKEN", app)
		}
	}
	mux := http.NewServeMux()
	mux.Handle("/mcp", mcpHandler)
	mux.Handle("/tools", plain)
	mux.Handle("/tools/", plain)
	if app != nil {
		mux.Handle("/", app)
		// A probe (a load balancer, Kubernetes) has no token, and a
		// health answer says nothing a token protects.
		mux.Handle("GET /healthz", open)
		mux.Handle("GET /readyz", open)
	}
	return mux, nil
}

// server is an HTTP server whose port is bound and that is not running yet.
type server struct {
	name string
	ln   net.Listener
	srv  *http.Server
}

// listen binds addr for h, with the configured bounds on slow and idle
// clients and on the connections held at once.
func (a *App) listen(name, addr string, h http.Handler) (*server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s: listening on %s: %w", name, addr, err)
	}
	c := a.cfg.HTTPServer
	guard := newConnGuard(ln, c.MaxConns, c.MaxConnsPerClient)
	s := &server{name: name, ln: guard}
	s.srv = &http.Server{
		ConnState:         guard.track,
		ConnContext:       withConn,
		Handler:           guard.minBodyRate(guardHosts(a.allowedHosts(s), h), c.MinBodyRate, c.ReadHeaderTimeout, c.ReadTimeout),
		ReadHeaderTimeout: c.ReadHeaderTimeout,
		ReadTimeout:       c.ReadTimeout,
		WriteTimeout:      c.WriteTimeout,
		IdleTimeout:       c.IdleTimeout,
		MaxHeaderBytes:    c.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(a.logger.Handler(), slog.LevelDebug),
	}
	return s, nil
}

func (s *server) loopback() bool {
	tcp, ok := s.ln.Addr().(*net.TCPAddr)
	return ok && tcp.IP.IsLoopback()
}

// run serves in g until ctx ends, then shuts the server down gracefully.
func (s *server) run(ctx context.Context, g *errgroup.Group, shutdown time.Duration) {
	g.Go(func() error {
		if err := s.srv.Serve(s.ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdown)
		defer cancel()
		return s.srv.Shutdown(sctx)
	})
}

// TraceHTTP wraps an HTTP handler of the application's API so that the
// request's W3C trace context and X-Correlation-ID reach the events it
// publishes (and answers with the correlation id).
func (a *App) TraceHTTP(route string, h http.Handler) http.Handler { return a.tracer.HTTP(route, h) }
