// Package console is Ferry's operator console: what is pending, what keeps
// failing and why, what sits in the poison store, and the actions to put
// it right, in a browser. It is server-rendered with html/template and a
// little htmx (vendored and embedded: nothing is fetched at run time), and
// it is an http.Handler, mounted by the app on its admin server at
// /console and embeddable in a server of your own.
//
// Reading needs a login (or the admin token as a Bearer header), from
// loopback too: a reverse proxy or a tunnel on the host makes every request
// look local. Config.OpenReads (FERRY_CONSOLE_OPEN_READS) lets loopback read
// without one, for an operator who chose it. Every state-changing action
// needs the token, always. Actions are
// protected against cross-site requests (http.CrossOriginProtection and a
// per-session form token), always show the count first and ask to
// confirm, and land in the audit log (ferry_audit_log), which the console,
// `ferry audit` and `ferry status --json` show.
package console

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgsession"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/tenancy"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config configures the console.
type Config struct {
	// Token is the admin token: reading and acting need it (as a session
	// from the login form, or a Bearer header). Empty: actions are refused,
	// and so is reading unless OpenReads.
	Token string
	// OpenReads lets requests from loopback read without logging in.
	// Default false: a reverse proxy, an SSH tunnel or a sidecar on the
	// host makes every request look like loopback, and the console shows
	// payloads and failure reasons. Set it only where nothing on the host
	// forwards requests. Actions need the token either way.
	OpenReads bool
	// Prefix is the path the console is mounted at. Default "/console".
	Prefix string
	// OutboxTable is the outbox (the zero Table is the default).
	OutboxTable pgoutbox.Table
	// OutboxRetention, LedgerRetention and PruneInterval say when a
	// partition of the outbox or the ledger is late to be cleared
	// (attention.State); zero: not judged.
	OutboxRetention, LedgerRetention, PruneInterval time.Duration
	// IdentityHeader, if set, names the request header in which an
	// authenticating proxy in front of the console passes who the user is
	// (X-Forwarded-Email, X-Auth-Request-User): a login records it with the
	// session, and the audit log names it. Leave it empty unless such a
	// proxy sets it on every request: a client could send it too.
	IdentityHeader string
	// Unrouted, if set, reads the broker's unrouted queue depth.
	Unrouted func(context.Context) (int, error)
	// Queues, if set, inspects the route table's queues (ready messages
	// and consumers of each, and the handler consuming each: a held
	// partition's page counts what waits behind its head by it).
	Queues func(context.Context) ([]rabbit.QueueStat, error)
	// Routes are the application's route names, for the handlers page
	// (pause and resume).
	Routes []string
	// Events are the application's event types (app.Options.Events): a
	// stored event of an older version is also shown as the current one,
	// as its handler will see it, or with the reason it will refuse it.
	Events []evolve.Schema
	// MaxBackgroundRows bounds what one confirmation of a poison store
	// requeue or discard takes (the oldest first; the confirmation says how
	// many more there are). Over MaxActionRows the action runs in the
	// background with a page of its own. Default DefaultMaxBackgroundRows.
	MaxBackgroundRows int
	// TrustedProxies are the addresses of the reverse proxies in front of
	// the console (FERRY_CONSOLE_TRUSTED_PROXIES): a request from one of
	// them is from the client its X-Forwarded-For names (the nearest
	// address that is not a trusted proxy), and its X-Forwarded-Proto says
	// whether the client used TLS. Without them, the peer is the client:
	// behind a proxy every login looked like the proxy's, and one
	// stranger's wrong logins kept every operator out.
	TrustedProxies []netip.Prefix
	// SecureCookies marks the session cookie Secure whatever the request
	// says (FERRY_CONSOLE_SECURE_COOKIES): for TLS that ends in a proxy
	// that sends no X-Forwarded-Proto. It is Secure anyway when TLS ends in
	// this process or a trusted proxy says https.
	SecureCookies bool
	// IdleTimeout ends a session unused this long
	// (FERRY_CONSOLE_IDLE_TIMEOUT). Default DefaultIdleTimeout.
	IdleTimeout time.Duration
	// MaxSearches bounds the searches ("find a message") running at once;
	// more are answered 429. Each holds a connection of the pool the
	// consumers share for up to pgstatus.FindTimeout per store. Default
	// DefaultMaxSearches.
	MaxSearches int
	// MaskFields are payload fields (JSON object keys, at any depth, any
	// case) whose values reader pages show as "<masked>"
	// (FERRY_CONSOLE_MASK_FIELDS): a card holder's name or an address a
	// payload must carry but operators need not read. A payload that is
	// not JSON is then hidden whole. The stores keep the payload as
	// published.
	MaskFields []string
	// Tenants, if set, reads every tenant's status (tenancy.Statuses): the
	// console of a tenant fleet (FERRY_TENANTS) then has a tenants page,
	// with Pause and Resume, and its overview names the tenants that need
	// a human. Nil: a single database.
	Tenants func(context.Context) ([]tenancy.Status, error)
	// ConfirmTTL is how long a confirmation page can be acted on: it
	// binds the ids it counted, and minutes later they may no longer be
	// what the operator would choose. Default pgconfirm.DefaultTTL (10m).
	ConfirmTTL time.Duration
	// Logger receives the console's log lines. Default: discard.
	Logger *slog.Logger
}

// Console is the console's handler.
type Console struct {
	cfg    Config
	pool   *pgxpool.Pool
	store  *pgpoison.Store
	ops    *pgoutbox.Operator
	tmpl   *template.Template
	mux    *http.ServeMux
	logins loginLimiter
	// searches holds a token per search running (Config.MaxSearches).
	searches chan struct{}
	// tenants is the overview's last read of the tenants (Config.Tenants).
	tenants tenantsCache
}

// DefaultMaxSearches is Config.MaxSearches's default.
const DefaultMaxSearches = 2

// Failed logins allowed per client address: LoginBurst at once, then one
// every LoginEvery. Guessing a 16-character token is hopeless anyway; the
// bound keeps a script from trying and fills no log. Only failures count,
// and a valid token is never refused: a stranger's wrong logins from the
// operators' address (a shared proxy's, a NAT's) cannot keep them out.
const (
	LoginBurst = 5
	LoginEvery = 12 * time.Second
)

// loginLimiter bounds login attempts per client address (golang.org/x/time/rate
// per address, the oldest forgotten past maxLoginClients).
type loginLimiter struct {
	mu      sync.Mutex
	clients map[string]*rate.Limiter
}

const maxLoginClients = 10_000

// failed counts a failed login from host and says whether it is within
// the bound, and if not how long until the next attempt is.
func (l *loginLimiter) failed(host string) (bool, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.clients == nil || len(l.clients) > maxLoginClients {
		l.clients = map[string]*rate.Limiter{}
	}
	lim := l.clients[host]
	if lim == nil {
		lim = rate.NewLimiter(rate.Every(LoginEvery), LoginBurst)
		l.clients[host] = lim
	}
	res := lim.Reserve()
	if d := res.Delay(); d > 0 {
		res.Cancel()
		return false, d
	}
	return true, 0
}

const sessionCookie = "ferry_console"

// New returns the console over pool and the poison store.
func New(pool *pgxpool.Pool, store *pgpoison.Store, cfg Config) (*Console, error) {
	if pool == nil || store == nil {
		return nil, errors.New("console: New needs a pool and a poison store")
	}
	if cfg.MaxSearches <= 0 {
		cfg.MaxSearches = DefaultMaxSearches
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/console"
	}
	cfg.Prefix = "/" + strings.Trim(cfg.Prefix, "/")
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxBackgroundRows == 0 {
		cfg.MaxBackgroundRows = DefaultMaxBackgroundRows
	}
	if cfg.MaxBackgroundRows < MaxActionRows {
		return nil, fmt.Errorf("console: MaxBackgroundRows (%d) must be at least MaxActionRows (%d)", cfg.MaxBackgroundRows, MaxActionRows)
	}
	ops, err := pgoutbox.NewOperator(pool, cfg.OutboxTable)
	if err != nil {
		return nil, err
	}
	c := &Console{cfg: cfg, pool: pool, store: store, ops: ops, searches: make(chan struct{}, cfg.MaxSearches)}
	tmpl, err := template.New("").Funcs(c.funcs()).ParseFS(templateFS, "templates/*.html")
	if err != nil {
		return nil, err
	}
	c.tmpl = tmpl
	static, _ := fs.Sub(staticFS, "static")
	p := cfg.Prefix
	mux := http.NewServeMux()
	mux.Handle("GET "+p+"/static/", http.StripPrefix(p+"/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET "+p+"/login", c.loginForm)
	mux.HandleFunc("POST "+p+"/login", c.login)
	mux.HandleFunc("POST "+p+"/logout", c.act(c.logout))
	mux.HandleFunc("GET "+p+"/{$}", c.read(c.overviewPage))
	mux.HandleFunc("GET "+p+"/overview", c.read(c.overviewPartial))
	mux.HandleFunc("GET "+p+"/poison", c.read(c.poisonPage))
	mux.HandleFunc("GET "+p+"/poison/{id}", c.read(c.detailPage))
	mux.HandleFunc("GET "+p+"/failing", c.read(c.failingPage))
	mux.HandleFunc("GET "+p+"/audit", c.read(c.auditPage))
	mux.HandleFunc("POST "+p+"/actions", c.act(c.action))
	mux.HandleFunc("POST "+p+"/undo", c.act(c.undo))
	mux.HandleFunc("GET "+p+"/held/{consumer}", c.read(c.heldPage))
	mux.HandleFunc("GET "+p+"/handlers", c.read(c.handlersPage))
	mux.HandleFunc("GET "+p+"/tenants", c.read(c.tenantsPage))
	mux.HandleFunc("POST "+p+"/tenant-actions", c.act(c.tenantAction))
	mux.HandleFunc("GET "+p+"/search", c.read(c.searchPage))
	mux.HandleFunc("POST "+p+"/handler-actions", c.act(c.handlerAction))
	mux.HandleFunc("POST "+p+"/held-actions", c.act(c.heldAction))
	mux.HandleFunc("GET "+p+"/jobs/{id}", c.read(c.jobPage))
	mux.HandleFunc("GET "+p+"/retrying", c.read(c.retryingPage))
	mux.HandleFunc("GET "+p+"/failing/{id}", c.read(c.outboxRowPage))
	mux.HandleFunc("POST "+p+"/outbox-actions", c.act(c.outboxAction))
	c.mux = mux
	return c, nil
}

// ServeHTTP implements http.Handler. Cross-origin state changes are
// refused before anything else (Sec-Fetch-Site / Origin).
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "same-origin")
	csrf.Handler(c.mux).ServeHTTP(w, r)
}

var csrf = http.NewCrossOriginProtection()

func (c *Console) mac(purpose string) string {
	m := hmac.New(sha256.New, []byte(c.cfg.Token))
	m.Write([]byte(purpose))
	return hex.EncodeToString(m.Sum(nil))
}

// who is the caller a request was authenticated as: Bearer (the admin
// token in a header: a script), or a console session.
type who struct {
	ok      bool
	bearer  bool
	session pgsession.Session
}

type whoKey struct{}

// whoIs authenticates r once: the Bearer header, or the session cookie the
// login form set, checked against the server's sessions (so a cookie kept
// after logging out, or copied elsewhere, no longer works). The answer is
// kept in the request's context for the rest of the request.
func (c *Console) whoIs(r *http.Request) who {
	if w, ok := r.Context().Value(whoKey{}).(who); ok {
		return w
	}
	if c.cfg.Token == "" {
		return who{}
	}
	if scheme, tok, ok := strings.Cut(r.Header.Get("Authorization"), " "); ok && strings.EqualFold(scheme, "Bearer") {
		return who{ok: subtle.ConstantTimeCompare([]byte(strings.TrimSpace(tok)), []byte(c.cfg.Token)) == 1, bearer: true}
	}
	ck, err := r.Cookie(sessionCookie)
	if err != nil {
		return who{}
	}
	// "<session id>.<mac>": the mac keeps a forged id from costing a
	// query; the session itself lives on the server.
	id, sig, ok := strings.Cut(ck.Value, ".")
	if !ok || len(id) != 32 || subtle.ConstantTimeCompare([]byte(sig), []byte(c.mac("session\x00"+id))) != 1 {
		return who{}
	}
	s, err := pgsession.Get(r.Context(), c.pool, id, c.cfg.IdleTimeout)
	if err != nil {
		if !errors.Is(err, pgsession.ErrNone) {
			c.cfg.Logger.ErrorContext(r.Context(), "console: reading the session", "error", err)
		}
		return who{}
	}
	return who{ok: true, session: s}
}

// withWho keeps r's authentication in its context, and its client
// address for the audit entries its actions write.
func (c *Console) withWho(r *http.Request) *http.Request {
	ctx := pgaudit.WithAddress(r.Context(), c.client(r).String())
	return r.WithContext(context.WithValue(ctx, whoKey{}, c.whoIs(r.WithContext(ctx))))
}

// authed reports whether r carries the admin token or a live session.
func (c *Console) authed(r *http.Request) bool { return c.whoIs(r).ok }

// csrf is the form token of r's session: each session has its own, and it
// ends with the session.
func (c *Console) csrf(r *http.Request) string {
	w := c.whoIs(r)
	if !w.ok || w.bearer {
		return ""
	}
	return c.mac("csrf\x00" + w.session.ID)
}

// actor is who acts, for the audit log: the identity the session was
// started with (the authenticating proxy's, FERRY_CONSOLE_IDENTITY_HEADER),
// or the token's holder. Where the request came from is the entry's
// Address (pgaudit.WithAddress, set per request), never part of this text.
func (c *Console) actor(r *http.Request) string {
	w := c.whoIs(r)
	switch {
	case w.bearer:
		return "console token-holder"
	case w.session.Identity != "":
		return "console " + w.session.Identity
	}
	return "console session " + w.session.ID[:8]
}

// client is the address r came from: the peer, or behind a trusted proxy
// the nearest forwarded address that is not one (X-Forwarded-For, read
// from the right: the entries on the left are the client's to write).
func (c *Console) client(r *http.Request) netip.Addr {
	peer, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		a, _ := netip.ParseAddr(r.RemoteAddr)
		return a
	}
	addr := peer.Addr().Unmap()
	if !c.trusted(addr) {
		return addr
	}
	var hops []string
	for _, h := range r.Header.Values("X-Forwarded-For") {
		hops = append(hops, strings.Split(h, ",")...)
	}
	for i := len(hops) - 1; i >= 0; i-- {
		a, err := netip.ParseAddr(strings.TrimSpace(hops[i]))
		if err != nil {
			return addr // a hop we cannot read: stop at the last one we trust
		}
		if addr = a.Unmap(); !c.trusted(addr) {
			return addr
		}
	}
	return addr
}

func (c *Console) trusted(a netip.Addr) bool {
	for _, p := range c.cfg.TrustedProxies {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// secure says whether the session cookie must be Secure: TLS ended here,
// a trusted proxy says the client used https, or the operator says so.
func (c *Console) secure(r *http.Request) bool {
	if r.TLS != nil || c.cfg.SecureCookies {
		return true
	}
	if peer, err := netip.ParseAddrPort(r.RemoteAddr); err == nil && c.trusted(peer.Addr().Unmap()) {
		return strings.EqualFold(strings.TrimSpace(strings.Split(r.Header.Get("X-Forwarded-Proto"), ",")[0]), "https")
	}
	return false
}

// SessionLifetime is how long a console login lasts at most.
const SessionLifetime = 12 * time.Hour

// DefaultIdleTimeout is Config.IdleTimeout's default: a session unused
// this long ends, as a screen left unlocked should.
const DefaultIdleTimeout = 30 * time.Minute

// loopback says whether r's client is this host (behind a trusted proxy,
// the forwarded client, not the proxy).
func (c *Console) loopback(r *http.Request) bool { return c.client(r).IsLoopback() }

// read lets a request read: logged in (or with the Bearer token), or from
// loopback when the operator opened reads there.
func (c *Console) read(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r = c.withWho(r)
		if !c.authed(r) && !(c.cfg.OpenReads && c.loopback(r)) {
			if c.cfg.Token == "" {
				c.fail(w, r, http.StatusForbidden, "reading the console needs a login: set FERRY_ADMIN_TOKEN, or FERRY_CONSOLE_OPEN_READS=true to let loopback read without one")
				return
			}
			http.Redirect(w, r, c.cfg.Prefix+"/login?"+url.Values{"next": {r.URL.RequestURI()}}.Encode(), http.StatusSeeOther)
			return
		}
		h(w, r)
	}
}

// act lets a request change state: with the token and the session's form
// token, always.
func (c *Console) act(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r = c.withWho(r)
		if c.cfg.Token == "" {
			c.fail(w, r, http.StatusForbidden, "actions are off: set FERRY_ADMIN_TOKEN (and log in) to requeue or discard")
			return
		}
		if !c.authed(r) {
			c.fail(w, r, http.StatusUnauthorized, "log in with the admin token to requeue or discard")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if err := r.ParseForm(); err != nil {
			c.fail(w, r, http.StatusBadRequest, "the form could not be read")
			return
		}
		// The Bearer header cannot be sent cross-site; a cookie session also
		// needs the form token only the console's own pages carry.
		if !c.whoIs(r).bearer && subtle.ConstantTimeCompare([]byte(r.PostForm.Get("csrf")), []byte(c.csrf(r))) != 1 {
			c.fail(w, r, http.StatusForbidden, "the form's token is missing or stale: reload the page")
			return
		}
		h(w, r)
	}
}

func (c *Console) loginForm(w http.ResponseWriter, r *http.Request) {
	c.render(w, r, "login", &loginPage{Off: c.cfg.Token == "", Next: c.next(r.URL.Query().Get("next"))})
}

// next is where to go after logging in: a page of the console (the one
// the operator was on), never another site.
func (c *Console) next(v string) string {
	u, err := url.Parse(v)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || strings.HasPrefix(v, "//") || strings.Contains(v, "\\") ||
		!(u.Path == c.cfg.Prefix || strings.HasPrefix(u.Path, c.cfg.Prefix+"/")) || strings.HasSuffix(u.Path, "/login") {
		return c.cfg.Prefix + "/poison"
	}
	return u.RequestURI()
}

// logout ends the session on the server (a copy of the cookie kept
// anywhere no longer works) and clears the cookie.
func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	if who := c.whoIs(r); who.ok && !who.bearer {
		if err := pgsession.End(r.Context(), c.pool, who.session.ID); err != nil {
			c.internal(w, r, err)
			return
		}
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: c.cfg.Prefix, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: c.secure(r), MaxAge: -1})
	http.Redirect(w, r, c.cfg.Prefix+"/", http.StatusSeeOther)
}

func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 4096)
	if c.cfg.Token == "" || r.ParseForm() != nil || subtle.ConstantTimeCompare([]byte(r.PostForm.Get("token")), []byte(c.cfg.Token)) != 1 {
		if ok, wait := c.logins.failed(c.client(r).String()); !ok {
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())+1))
			c.fail(w, r, http.StatusTooManyRequests, fmt.Sprintf("Too many failed logins from this address: try again in %d s.", int(wait.Seconds())+1))
			return
		}
		w.WriteHeader(http.StatusUnauthorized)
		c.render(w, r, "login", &loginPage{Off: c.cfg.Token == "", Wrong: true, Next: c.next(r.PostForm.Get("next"))})
		return
	}
	identity := ""
	if c.cfg.IdentityHeader != "" {
		identity = pipeline.CleanText(r.Header.Get(c.cfg.IdentityHeader), 200)
	}
	sess, err := pgsession.Start(r.Context(), c.pool, identity, SessionLifetime)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: sess.ID + "." + c.mac("session\x00"+sess.ID), Path: c.cfg.Prefix, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: c.secure(r), MaxAge: int(SessionLifetime.Seconds())})
	http.Redirect(w, r, c.next(r.PostForm.Get("next")), http.StatusSeeOther)
}

func (c *Console) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	w.WriteHeader(status)
	c.render(w, r, "error", &errorPage{Message: msg, Status: status})
}

func (c *Console) render(w http.ResponseWriter, r *http.Request, name string, data pageData) {
	ch := chrome{Prefix: c.cfg.Prefix, Authed: c.authed(r), CanAct: c.cfg.Token != "", Page: name, Here: r.URL.RequestURI(), CSRF: c.csrf(r), Tenants: c.cfg.Tenants != nil}
	data.setChrome(ch)
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := c.tmpl.ExecuteTemplate(w, name, data); err != nil {
		c.cfg.Logger.ErrorContext(r.Context(), "console: rendering failed", "page", name, "error", err)
	}
}
