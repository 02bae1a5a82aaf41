package console_test

import (
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// loginFrom posts a login as the client behind the test's proxy whose
// X-Forwarded-For is forwarded (empty: none), and returns the status and
// the response.
func loginFrom(t *testing.T, srv *httptest.Server, tok, forwarded string, header http.Header) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/console/login", strings.NewReader(url.Values{"token": {tok}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if forwarded != "" {
		req.Header.Set("X-Forwarded-For", forwarded)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	return resp
}

// Failed logins are bounded per client address, and only failures count:
// a script guessing gets 429 with Retry-After after console.LoginBurst
// failures, while the right token always gets in. Behind the operators'
// reverse proxy (all logins from one peer address), a stranger's wrong
// logins kept the real token out 6 times of 6.
func TestAStrangersWrongLoginsDoNotKeepTheTokenOut(t *testing.T) {
	t.Parallel()
	proxy := netip.MustParsePrefix("127.0.0.0/8")
	srv, _ := setupWith(t, func(c *console.Config) { c.TrustedProxies = []netip.Prefix{proxy} })
	// The stranger, through the same proxy: one wrong login a second.
	for i := range console.LoginBurst {
		require.Equal(t, http.StatusUnauthorized, loginFrom(t, srv, "guess", "203.0.113.9", nil).StatusCode, "try %d", i+1)
	}
	resp := loginFrom(t, srv, "guess", "203.0.113.9", nil)
	require.Equal(t, http.StatusTooManyRequests, resp.StatusCode, "the stranger is bounded")
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	// The operator, through the proxy, and the stranger's own address with
	// the right token: both get in.
	for range 6 {
		require.Equal(t, http.StatusSeeOther, loginFrom(t, srv, token, "198.51.100.7", nil).StatusCode, "the operator gets in")
	}
	require.Equal(t, http.StatusSeeOther, loginFrom(t, srv, token, "203.0.113.9", nil).StatusCode, "a valid token is never refused")
	// A client cannot pick its address by writing X-Forwarded-For itself:
	// the proxy appends the peer it saw, and that is the one read.
	require.Equal(t, http.StatusTooManyRequests, loginFrom(t, srv, "guess", "198.51.100.7, 203.0.113.9", nil).StatusCode)
}

// Without trusted proxies the peer is the client: a forged
// X-Forwarded-For changes nothing, and failures still only count against
// the peer that failed.
func TestForwardedForIsIgnoredWithoutTrustedProxies(t *testing.T) {
	t.Parallel()
	srv, _ := setup(t)
	for i := 0; i < console.LoginBurst; i++ {
		require.Equal(t, http.StatusUnauthorized, loginFrom(t, srv, "guess", "198.51.100."+string(rune('1'+i)), nil).StatusCode)
	}
	require.Equal(t, http.StatusTooManyRequests, loginFrom(t, srv, "guess", "192.0.2.200", nil).StatusCode, "one peer, one bound")
	require.Equal(t, http.StatusSeeOther, loginFrom(t, srv, token, "", nil).StatusCode)
}

// The session cookie is Secure when TLS ends in a trusted proxy that says
// so, or when the operator says so; not on plain HTTP.
func TestSessionCookieIsSecureBehindATLSProxy(t *testing.T) {
	t.Parallel()
	proxied, _ := setupWith(t, func(c *console.Config) { c.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")} })
	resp := loginFrom(t, proxied, token, "198.51.100.7", http.Header{"X-Forwarded-Proto": {"https"}})
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.True(t, resp.Cookies()[0].Secure, "TLS ended in the proxy")
	resp = loginFrom(t, proxied, token, "198.51.100.7", nil)
	require.False(t, resp.Cookies()[0].Secure, "plain HTTP all the way")
	plain, _ := setup(t)
	resp = loginFrom(t, plain, token, "", http.Header{"X-Forwarded-Proto": {"https"}})
	require.False(t, resp.Cookies()[0].Secure, "an untrusted peer's X-Forwarded-Proto is not believed")
	forced, _ := setupWith(t, func(c *console.Config) { c.SecureCookies = true })
	resp = loginFrom(t, forced, token, "", nil)
	require.True(t, resp.Cookies()[0].Secure, "FERRY_CONSOLE_SECURE_COOKIES")
}

// A session unused for the idle timeout ends: its cookie sends the browser
// to the login page.
func TestAnIdleSessionEnds(t *testing.T) {
	t.Parallel()
	srv, _ := setupWith(t, func(c *console.Config) { c.IdleTimeout = time.Second })
	browser := loggedIn(t, srv)
	code, _ := get(t, browser, srv.URL+"/console/poison")
	require.Equal(t, http.StatusOK, code)
	time.Sleep(1500 * time.Millisecond)
	code, _ = get(t, browser, srv.URL+"/console/poison")
	require.Equal(t, http.StatusSeeOther, code, "sent to the login page")
}

// The audit log keeps the identity and the client address apart: an
// identity header cannot write an address ("oncall@corp.example
// 10.9.9.9:1" was one actor).
func TestAuditKeepsIdentityAndAddressApart(t *testing.T) {
	t.Parallel()
	srv, pool := setupWith(t, func(c *console.Config) { c.IdentityHeader = "X-Forwarded-Email" })
	browser := newBrowser()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/console/login", strings.NewReader(url.Values{"token": {token}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("X-Forwarded-Email", "oncall@corp.example 10.9.9.9:1")
	resp, err := browser.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	_, page := get(t, browser, srv.URL+"/console/poison")
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "action": {"discard"}, "scope": {"filter"}, "handler": {"payments.charge"}}
	code, body := postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusOK, code, body)
	withConfirmation(form, body)
	code, _ = postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusSeeOther, code)
	entries := pipelinetest.Audited(t, pool, "poison.discard")
	require.Len(t, entries, 1)
	require.Equal(t, "console oncall@corp.example 10.9.9.9:1", entries[0].Actor, "the identity as the proxy sent it")
	require.Equal(t, "127.0.0.1", entries[0].Address, "the address in a field of its own, from the connection")
}
