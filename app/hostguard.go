package app

import (
	"net"
	"net/http"
	"slices"
	"strings"
)

// loopbackHosts are the Host names a loopback-bound server answers by
// default: the names a browser on this machine uses to reach it.
var loopbackHosts = []string{"localhost", "127.0.0.1", "::1"}

// guardHosts refuses, with 421 Misdirected Request, a request whose Host
// is not one of allowed (host names without port, compared without case;
// "*" allows any). It is the defence against DNS rebinding: a web page on
// evil.example whose name is made to resolve to 127.0.0.1 reaches a
// loopback server with "Host: evil.example", and without this check could
// place an order or read the console. Written by hand: net/http's
// CrossOriginProtection compares Origin with Host, which a rebound page
// makes equal, so it cannot tell.
//
// State-changing requests are also checked by net/http's
// CrossOriginProtection: a browser's cross-site POST (by Sec-Fetch-Site,
// or an Origin naming another host) is refused with 403. Clients that are
// not browsers (curl, MCP hosts, other services) send neither and pass.
func guardHosts(allowed []string, next http.Handler) http.Handler {
	cop := http.NewCrossOriginProtection()
	guarded := cop.Handler(next)
	any := slices.Contains(allowed, "*")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !any && !hostAllowed(allowed, r.Host) {
			http.Error(w, "unknown Host: this server answers only the names in FERRY_HTTP_ALLOWED_HOSTS", http.StatusMisdirectedRequest)
			return
		}
		guarded.ServeHTTP(w, r)
	})
}

func hostAllowed(allowed []string, hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.Trim(host, "[]"), ".")
	return slices.ContainsFunc(allowed, func(a string) bool { return strings.EqualFold(a, host) })
}

// allowedHosts is the Host allow-list of a server: FERRY_HTTP_ALLOWED_HOSTS
// when set; otherwise the loopback names (and the bound host) on a
// loopback server, and any Host on a server bound beyond loopback, whose
// public names Ferry cannot know (set the variable there).
func (a *App) allowedHosts(s *server) []string {
	if len(a.cfg.HTTPServer.AllowedHosts) > 0 {
		return a.cfg.HTTPServer.AllowedHosts
	}
	if !s.loopback() {
		return []string{"*"}
	}
	hosts := slices.Clone(loopbackHosts)
	if tcp, ok := s.ln.Addr().(*net.TCPAddr); ok {
		hosts = append(hosts, tcp.IP.String())
	}
	return hosts
}
