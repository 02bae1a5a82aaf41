package app

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"net/http"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/tenancy"
)

// AdminHandler serves the admin endpoints:
//
//	GET  /metrics       Prometheus metrics
//	GET  /healthz       the process is up
//	GET  /readyz        database and broker reachable, migrations current (503 otherwise)
//	POST /admin/prune   prune the outbox and the ledger now (Bearer FERRY_ADMIN_TOKEN)
//	     /console/      the operator console (package console): reading and
//	                    acting need a login with FERRY_ADMIN_TOKEN
//	                    (FERRY_CONSOLE_OPEN_READS=true: loopback reads without)
//
// The admin server listens on loopback by default (FERRY_ADMIN_ADDR).
func (a *App) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	if con, err := a.Console(); err == nil {
		mux.Handle("/console/", con)
		mux.Handle("GET /console", http.RedirectHandler("/console/", http.StatusMovedPermanently))
	} else {
		a.logger.Error("the console could not be built", "error", err)
	}
	mux.Handle("GET /metrics", a.metrics.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		checks, ok := a.Ready(r.Context())
		status := http.StatusOK
		if !ok {
			status = http.StatusServiceUnavailable
		}
		writeAdminJSON(w, status, checks)
	})
	mux.Handle("POST /admin/prune", a.requireToken(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		res, err := a.Prune(r.Context())
		if err != nil {
			writeAdminJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
			return
		}
		writeAdminJSON(w, http.StatusOK, res)
	})))
	return mux
}

// Console is the operator console on this app's database, poison store and
// broker, for mounting at /console/ in a server of your own (AdminHandler
// mounts it on the admin server).
func (a *App) Console() (*console.Console, error) {
	cfg := console.Config{Token: a.cfg.AdminToken, OutboxTable: a.cfg.Relay.Table,
		OutboxRetention: a.cfg.Retention.Outbox, LedgerRetention: a.cfg.Retention.Ledger, PruneInterval: a.cfg.Retention.Interval, IdentityHeader: a.cfg.ConsoleIdentityHeader, OpenReads: a.cfg.ConsoleOpenReads, ConfirmTTL: a.cfg.ConsoleConfirmTTL, TrustedProxies: a.cfg.ConsoleTrustedProxies, SecureCookies: a.cfg.ConsoleSecureCookies, IdleTimeout: a.cfg.ConsoleIdleTimeout, MaskFields: a.cfg.ConsoleMaskFields, Events: a.opts.Events, Logger: a.logger}
	// An app without a broker connection (ferry serve of a producing
	// service) reads the broker on a connection of its own, as ferry
	// status does: its console shows the same state.
	for _, r := range a.routes {
		cfg.Routes = append(cfg.Routes, r.Name)
	}
	cfg.Unrouted = a.UnroutedDepth
	cfg.Queues = a.QueueStats
	if a.cfg.Tenants {
		cfg.Tenants = a.TenantStatuses
	}
	return console.New(a.pool, a.poison, cfg)
}

// TenantStatuses reads every tenant's status from the registry and each
// tenant's database (tenancy.Statuses): what `ferry tenants status` and
// the console's tenants page show.
func (a *App) TenantStatuses(ctx context.Context) ([]tenancy.Status, error) {
	ts, err := pgtenants.List(ctx, a.pool)
	if err != nil {
		return nil, err
	}
	rows, _, err := tenancy.Statuses(ctx, a.pool, tenancy.StatusConfig{ControlURL: a.cfg.DatabaseURL, Outbox: a.cfg.Relay.Table, Poison: a.poison}, ts)
	return rows, err
}

// Ready checks what a process needs to do its work.
func (a *App) Ready(ctx context.Context) (map[string]string, bool) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	checks, ok := map[string]string{}, true
	// The answer says what failed, not how: /readyz is unauthenticated,
	// and a driver's error text names hosts, users and databases. The
	// detail goes to the log.
	fail := func(name, answer string, err error) {
		checks[name], ok = answer, false
		a.logger.WarnContext(ctx, "readiness check failed", "check", name, "error", err)
	}
	if err := a.pool.Ping(ctx); err != nil {
		fail("database", "unreachable (see the process's log)", err)
	} else {
		checks["database"] = "ok"
	}
	if a.opts.WithoutBroker {
		checks["broker"] = "not used"
	} else if a.pubConn == nil || !a.pubConn.IsConnected() {
		checks["broker"], ok = "not connected (reconnecting)", false
	} else {
		checks["broker"] = "ok"
	}
	if pending, err := migrations.Pending(ctx, a.db); err != nil {
		fail("migrations", "could not be checked (see the process's log)", err)
	} else if pending {
		checks["migrations"], ok = "pending: run the migrate up command", false
	} else {
		checks["migrations"] = "ok"
	}
	return checks, ok
}

func (a *App) requireToken(next http.Handler) http.Handler {
	if a.cfg.AdminToken == "" {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			writeAdminJSON(w, http.StatusForbidden, map[string]string{"error": "state-changing admin endpoints are off: set FERRY_ADMIN_TOKEN"})
		})
	}
	return a.bearer(a.cfg.AdminToken, "FERRY_ADMIN_TOKEN", next)
}

// bearer lets through requests with "Authorization: Bearer <token>". The
// scheme is case-insensitive (RFC 9110 §11.1); the token is not.
func (a *App) bearer(token, variable string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, got, found := strings.Cut(r.Header.Get("Authorization"), " ")
		if !found || !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), []byte(token)) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			writeAdminJSON(w, http.StatusUnauthorized, map[string]string{"error": "missing or wrong Bearer token (" + variable + ")"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

func writeAdminJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
