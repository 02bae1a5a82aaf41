package console_test

import (
	"context"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

const token = "console-test-token-0123"

// withConfirmation copies what a confirmation page hands the action (its
// token, and the bound and nonce the token binds) into form, as a browser
// submitting that page does.
func withConfirmation(form url.Values, page string) {
	for _, k := range []string{"confirm", "nonce"} {
		form.Set(k, between(page, `name="`+k+`" value="`, `"`))
	}
}

// failOnRenderError fails the test when a page does not render: its typed
// data lacks a field its template names (which a map hid as blank).
type failOnRenderError struct{ t *testing.T }

func (h failOnRenderError) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (h failOnRenderError) Handle(_ context.Context, r slog.Record) error {
	attrs := ""
	r.Attrs(func(a slog.Attr) bool { attrs += " " + a.String(); return true })
	h.t.Errorf("console logged an error: %s%s", r.Message, attrs)
	return nil
}
func (h failOnRenderError) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h failOnRenderError) WithGroup(string) slog.Handler      { return h }

func setup(t *testing.T) (*httptest.Server, *pgxpool.Pool) {
	t.Helper()
	return setupWith(t, func(*console.Config) {})
}

// setupWith is setup with the console's configuration changed by f.
func setupWith(t *testing.T, f func(*console.Config)) (*httptest.Server, *pgxpool.Pool) {
	t.Helper()
	pool := pipelinetest.Postgres(t)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	cfg := console.Config{Token: token, OutboxTable: testTable, Logger: slog.New(failOnRenderError{t})}
	f(&cfg)
	c, err := console.New(pool, store, cfg)
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/console/", c)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	// Three of one group, a hostile one, and a huge one.
	for g := 1; g <= 3; g++ {
		pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{
			MessageID: fmt.Sprint("m", g), Topic: "stripe.charge", Handler: "payments.charge", AggregateID: fmt.Sprint("order-", g),
			Payload: fmt.Sprintf(`{"order_id":%d}`, g),
			Reason:  fmt.Sprintf("gave up after 5 attempts: charging order %d: payment provider answered 503 from 10.0.0.%d", g, g),
		})
	}
	pipelinetest.InsertPoison(t, pool,
		pipelinetest.PoisonRow{
			MessageID: "evil", Topic: "mail.send", Handler: "notifications.mail", Payload: `{"x":"</pre><script>alert(1)</script>"}`,
			Reason: "<script>alert(1)</script> \x1b[31m owned \u202e txt", Headers: map[string]string{"<img src=x onerror=alert(1)>": "<b>x</b>"},
		},
		pipelinetest.PoisonRow{
			MessageID: "huge", Topic: "mail.send", Handler: "notifications.mail", Payload: strings.Repeat("A", 1_000_000), Reason: strings.Repeat("r", 20_000),
		})
	return srv, pool
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func TestPagesEscapeAndBoundHostileContent(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	c := loggedIn(t, srv)
	for _, path := range []string{"/console/", "/console/overview", "/console/poison", "/console/failing", "/console/audit", "/console/static/htmx.min.js"} {
		code, _ := get(t, c, srv.URL+path)
		require.Equal(t, 200, code, path)
	}
	code, body := get(t, c, srv.URL+"/console/poison")
	require.Equal(t, 200, code)
	require.Contains(t, body, "payment provider answered 503 from &lt;ip&gt;", "grouped by fingerprint")
	require.Contains(t, body, `<td class="n">3</td>`)
	require.NotContains(t, body, "<script>alert(1)</script>")
	require.Contains(t, body, "&lt;script&gt;alert(1)&lt;/script&gt;")
	require.NotContains(t, body, "\x1b")
	require.NotContains(t, body, "\u202e")
	require.Contains(t, body, `\x1b[31m`)
	require.Less(t, len(body), 100_000, "a 20,000-character reason is cut in lists")

	evil := pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{MessageID: "evil"})[0]
	huge := pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{MessageID: "huge"})[0]
	code, body = get(t, c, srv.URL+"/console/poison/"+itoa(evil))
	require.Equal(t, 200, code)
	require.NotContains(t, body, "<script>alert(1)</script>")
	require.NotContains(t, body, "<img src=x")
	require.Contains(t, body, "&lt;/pre&gt;&lt;script&gt;")
	code, body = get(t, c, srv.URL+"/console/poison/"+itoa(huge))
	require.Equal(t, 200, code)
	require.Contains(t, body, "first 64 KiB only")
	require.Less(t, len(body), 200_000, "a 1 MB payload is shown bounded")

	// Filters.
	code, body = get(t, c, srv.URL+"/console/poison?handler=payments.charge&q=order+2")
	require.Equal(t, 200, code)
	require.Contains(t, body, "(1 under the filter)")
	code, _ = get(t, c, srv.URL+"/console/poison?since=yesterday")
	require.Equal(t, 400, code)
}

func TestActionsNeedTheTokenAndAreAudited(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	post := func(c *http.Client, form url.Values, header map[string]string) (*http.Response, string) {
		req, _ := http.NewRequest("POST", srv.URL+"/console/actions", strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := c.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	form := url.Values{"action": {"discard"}, "scope": {"filter"}, "handler": {"payments.charge"}}
	resp, _ := post(noRedirect, form, nil)
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "no token, no action")
	resp, _ = post(noRedirect, form, map[string]string{"Authorization": "Bearer " + token, "Sec-Fetch-Site": "cross-site"})
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "cross-site requests are refused")

	// A browser session: the login cookie alone is not enough without the form token.
	jar, _ := cookiejar.New(nil)
	browser := &http.Client{Jar: jar, CheckRedirect: noRedirect.CheckRedirect}
	resp, _ = post(browser, form, nil)
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	lr, err := browser.PostForm(srv.URL+"/console/login", url.Values{"token": {"wrong"}})
	require.NoError(t, err)
	lr.Body.Close()
	require.Equal(t, http.StatusUnauthorized, lr.StatusCode)
	lr, err = browser.PostForm(srv.URL+"/console/login", url.Values{"token": {token}})
	require.NoError(t, err)
	lr.Body.Close()
	require.Equal(t, http.StatusSeeOther, lr.StatusCode)
	resp, _ = post(browser, form, nil)
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "no form token")
	_, page := get(t, browser, srv.URL+"/console/poison")
	csrf := between(page, `name="csrf" value="`, `"`)
	require.NotEmpty(t, csrf)
	form.Set("csrf", csrf)

	// The count first, then the action.
	resp, body := post(browser, form, nil)
	require.Equal(t, 200, resp.StatusCode)
	require.Contains(t, body, `This will discard <b id="count">3</b> message(s)`)
	require.Equal(t, 5, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}), "the confirmation changes nothing")
	confirm := between(body, `name="confirm" value="`, `"`)
	require.NotEmpty(t, confirm)
	confirmPage := body
	form.Set("confirm", "1")
	resp, _ = post(browser, form, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "confirm=1 by itself confirms nothing: the count is asked again")
	other := url.Values{"action": {"discard"}, "scope": {"filter"}, "handler": {"mail.send"}, "csrf": {csrf}, "confirm": {confirm}}
	resp, _ = post(browser, other, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "a confirmation is bound to the selection it was given for")
	require.Equal(t, 5, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}))
	withConfirmation(form, confirmPage)
	resp, _ = post(browser, form, nil)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Location"), "discarded+3")
	require.Equal(t, 2, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}))
	audit := pipelinetest.Audited(t, pool, "")
	require.Len(t, audit, 1)
	actor, action, scope, count := audit[0].Actor, audit[0].Action, audit[0].Scope, audit[0].Count
	require.Equal(t, "poison.discard", action)
	require.Equal(t, 3, count)
	require.Contains(t, scope, "handler=payments.charge")
	require.Contains(t, actor, "console")
	_, body = get(t, browser, srv.URL+"/console/audit")
	require.Contains(t, body, "poison.discard")
}

// Reading needs a login, from loopback too (a proxy or a tunnel on the
// host looks like loopback); OpenReads lets loopback read without one,
// never a request from beyond it; without a token and OpenReads the
// console says what to set.
func TestReadingNeedsALoginUnlessLoopbackReadsAreOpened(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	serve := func(cfg console.Config, remote string, bearer bool) *httptest.ResponseRecorder {
		c, err := console.New(pool, store, cfg)
		require.NoError(t, err)
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/console/poison", nil)
		req.RemoteAddr = remote
		if bearer {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		c.ServeHTTP(rec, req)
		return rec
	}
	const local, far = "127.0.0.1:50000", "192.0.2.1:50000"
	for _, tc := range []struct {
		name   string
		cfg    console.Config
		remote string
		bearer bool
		want   int
	}{
		{"loopback, default", console.Config{Token: token}, local, false, http.StatusSeeOther},
		{"loopback over IPv6, default", console.Config{Token: token}, "[::1]:50000", false, http.StatusSeeOther},
		{"beyond loopback, default", console.Config{Token: token}, far, false, http.StatusSeeOther},
		{"loopback, opened", console.Config{Token: token, OpenReads: true}, local, false, http.StatusOK},
		{"beyond loopback, opened", console.Config{Token: token, OpenReads: true}, far, false, http.StatusSeeOther},
		{"bearer from beyond", console.Config{Token: token}, far, true, http.StatusOK},
		{"no token, not opened", console.Config{}, local, false, http.StatusForbidden},
		{"no token, opened", console.Config{OpenReads: true}, local, false, http.StatusOK},
	} {
		rec := serve(tc.cfg, tc.remote, tc.bearer)
		require.Equal(t, tc.want, rec.Code, tc.name)
		switch tc.want {
		case http.StatusSeeOther:
			require.Equal(t, "/console/login?next=%2Fconsole%2Fpoison", rec.Header().Get("Location"), tc.name)
		case http.StatusForbidden:
			require.Contains(t, rec.Body.String(), "FERRY_CONSOLE_OPEN_READS", tc.name)
		}
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func between(s, a, b string) string {
	i := strings.Index(s, a)
	if i < 0 {
		return ""
	}
	s = s[i+len(a):]
	j := strings.Index(s, b)
	if j < 0 {
		return ""
	}
	return s[:j]
}

// Failing outbox rows: grouped by fingerprint with first and last seen,
// filtered, and listed with their attempts, next try and last error.
func TestFailingRowsAreGroupedAndFiltered(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	var rows []pipelinetest.OutboxRow
	for g := 1; g <= 4; g++ {
		rows = append(rows, pipelinetest.OutboxRow{AggregateID: fmt.Sprint("a", g), Topic: "stripe.charge", Attempts: g,
			LastError: fmt.Sprintf("publishing to exchange %d: NOT_FOUND", g), AvailableAt: time.Now().Add(time.Minute)})
	}
	rows = append(rows, pipelinetest.OutboxRow{AggregateID: "b", Topic: "mail.send", Attempts: 2, LastError: "<script>x</script> broker \x1b closed"})
	pipelinetest.InsertOutbox(t, pool, testTable, rows...)
	reader := loggedIn(t, srv)
	code, body := get(t, reader, srv.URL+"/console/failing")
	require.Equal(t, 200, code)
	require.Contains(t, body, "publishing to exchange &lt;n&gt;: NOT_FOUND")
	require.Contains(t, body, `<td class="n">4</td>`)
	require.NotContains(t, body, "<script>x</script>")
	require.NotContains(t, body, "\x1b")
	code, body = get(t, reader, srv.URL+"/console/failing?topic=mail.send")
	require.Equal(t, 200, code)
	require.Equal(t, 1, strings.Count(body, `class="row-detail"`), "one row under the filter")
	code, body = get(t, reader, srv.URL+"/console/failing?q=not_found&aggregate=a3")
	require.Equal(t, 200, code)
	require.Contains(t, body, "<td>a3</td>")
	require.Equal(t, 1, strings.Count(body, `class="row-detail"`))
}

// A crafted link cannot turn a click into another action: only filter keys
// pass into the page's forms, a confirmation comes only from the confirm
// step, a repeated key is refused, and the success banner shows only what
// the console itself wrote. A session cookie stops working when it
// expires, whatever the browser keeps.
func TestCraftedLinksCannotActOrSpeak(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	browser := loggedIn(t, srv)

	_, page := get(t, browser, srv.URL+"/console/poison?topic=stripe.charge&action=discard&scope=filter&confirm=1&id=1&flash=All+good")
	form := page[strings.Index(page, `id="selection"`):]
	for _, injected := range []string{`type="hidden" name="action"`, `type="hidden" name="scope"`, `type="hidden" name="confirm"`, `type="hidden" name="id"`, `type="hidden" name="flash"`} {
		require.NotContains(t, form, injected)
	}
	require.Contains(t, form, `name="topic" value="stripe.charge"`, "the filter itself is kept")
	require.NotContains(t, page, "All good", "a link cannot write the success banner")

	csrf := between(page, `name="csrf" value="`, `"`)
	req, _ := http.NewRequest("POST", srv.URL+"/console/actions", strings.NewReader("csrf="+csrf+"&action=requeue&action=discard&scope=filter&topic=stripe.charge"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := browser.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "an action named twice is refused")
	require.Equal(t, 5, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}))

	for _, ck := range browser.Jar.Cookies(mustURL(t, srv.URL+"/console/")) {
		exp, sig, _ := strings.Cut(ck.Value, ".")
		require.NotEmpty(t, sig)
		stale := &http.Cookie{Name: ck.Name, Value: "1000000000." + sig}
		req, _ := http.NewRequest("POST", srv.URL+"/console/actions", strings.NewReader(url.Values{"csrf": {csrf}, "action": {"discard"}, "scope": {"filter"}}.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.AddCookie(stale)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "an expired session (was %s) is refused", exp)
	}
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	require.NoError(t, err)
	return u
}

// Paging: newest first, the older and newer links keep the filter and
// reach every page (the link was written with an escaped "=" and led back
// to page 1 without the filter), with the total under the filter.
func TestPagingReachesEveryPageWithTheFilter(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	var rows []pipelinetest.PoisonRow
	for g := 1; g <= 240; g++ {
		rows = append(rows, pipelinetest.PoisonRow{MessageID: fmt.Sprint("p", g), Topic: "mail.send", Handler: []string{"paged.even", "paged.odd"}[g%2],
			Reason: fmt.Sprint("boom ", g)})
	}
	pipelinetest.InsertPoison(t, pool, rows...)
	ids := pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{Handler: "paged.even"})
	slices.Reverse(ids)
	require.Len(t, ids, 120)

	shown := func(body string) []int64 {
		var out []int64
		for _, part := range strings.Split(body, `class="detail">#`)[1:] {
			n, err := strconv.ParseInt(part[:strings.Index(part, "<")], 10, 64)
			require.NoError(t, err)
			out = append(out, n)
		}
		return out
	}
	href := func(body, id string) string {
		i := strings.Index(body, `id="`+id+`"`)
		if i < 0 {
			return ""
		}
		start := strings.LastIndex(body[:i], `href="`) + len(`href="`)
		return html.UnescapeString(body[start : start+strings.Index(body[start:], `"`)])
	}
	reader := loggedIn(t, srv)
	code, body := get(t, reader, srv.URL+"/console/poison?handler=paged.even")
	require.Equal(t, 200, code)
	require.Contains(t, body, "(120 under the filter)")
	require.Equal(t, ids[:50], shown(body), "newest first")
	require.Empty(t, href(body, "newer"))
	var seen []int64
	seen = append(seen, shown(body)...)
	for page := 2; ; page++ {
		next := href(body, "next")
		if next == "" {
			break
		}
		require.Contains(t, next, "handler=paged.even", "the filter is kept")
		require.NotContains(t, next, "%3d")
		code, body = get(t, reader, srv.URL+next)
		require.Equal(t, 200, code, next)
		seen = append(seen, shown(body)...)
		if page == 3 {
			require.Len(t, shown(body), 20, "page 3 holds the last 20")
			newer := href(body, "newer")
			require.NotEmpty(t, newer)
			_, back := get(t, reader, srv.URL+newer)
			require.Equal(t, ids[50:100], shown(back), "newer goes back to page 2")
		}
	}
	require.Equal(t, ids, seen, "every message once, in order")
}

// Durable retries show in the console, by handler and reason, on their
// own page and on the overview; "retry now" and "discard" act on a group
// after the count is confirmed, and are audited. Failing outbox rows take
// the same actions.
func TestRetryingAndFailingRowsCanBeActedOn(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	var rows []pipelinetest.OutboxRow
	for g := 1; g <= 4; g++ {
		rows = append(rows, pipelinetest.OutboxRow{MessageUUID: fmt.Sprint("r", g), AggregateID: fmt.Sprint("o", g), Topic: pipeline.RetryTopic,
			Headers: map[string]string{"ferry_retry_queue": "notifications.mail", "ferry_attempt": "2",
				"ferry_last_error": fmt.Sprintf("mailing order %d: SMTP 451 try later", g)},
			AvailableAt: time.Now().Add(10 * time.Minute)})
	}
	pipelinetest.InsertOutbox(t, pool, testTable, rows...)
	pipelinetest.InsertOutbox(t, pool, testTable, failingRows("f", 2)...)
	browser := loggedIn(t, srv)

	_, overview := get(t, browser, srv.URL+"/console/")
	require.Contains(t, overview, `id="retrying-total" class="bad">4</b>`)
	attention := between(overview, `<ul id="attention">`, `</ul>`)
	require.Contains(t, attention, "4 message(s) retrying (most: 4 for notifications.mail", "the overview lists what ferry status does")
	require.Contains(t, attention, "no live relay")
	_, page := get(t, browser, srv.URL+"/console/retrying")
	require.Contains(t, page, "notifications.mail")
	require.Contains(t, page, "SMTP 451 try later")
	csrf := between(page, `name="csrf" value="`, `"`)
	fingerprint := html.UnescapeString(between(page, `name="fingerprint" value="`, `"`))
	require.NotEmpty(t, fingerprint)

	post := func(form url.Values) (int, string) {
		return postForm(t, browser, srv.URL+"/console/outbox-actions", form)
	}
	form := url.Values{"csrf": {csrf}, "kind": {"retrying"}, "action": {"retry-now"}, "scope": {"group"}, "handler": {"notifications.mail"}, "fingerprint": {fingerprint}}
	code, body := post(form)
	require.Equal(t, 200, code)
	require.Contains(t, body, `<b id="count">4</b>`)
	due, _ := dueRows(t, pool, pipeline.RetryTopic)
	require.Zero(t, due, "the count changes nothing")
	withConfirmation(form, body)
	code, _ = post(form)
	require.Equal(t, http.StatusSeeOther, code)
	due, _ = dueRows(t, pool, pipeline.RetryTopic)
	require.Equal(t, 4, due, "due at once")

	_, failing := get(t, browser, srv.URL+"/console/failing")
	ffp := html.UnescapeString(between(failing[strings.Index(failing, `value="failing"`):], `name="fingerprint" value="`, `"`))
	dform := url.Values{"csrf": {csrf}, "kind": {"failing"}, "action": {"discard"}, "scope": {"group"}, "fingerprint": {ffp}}
	_, body = post(dform)
	require.Contains(t, body, `<b id="count">2</b>`, body)
	withConfirmation(dform, body)
	code, _ = post(dform)
	require.Equal(t, http.StatusSeeOther, code)
	due, waiting := dueRows(t, pool, "stripe.charge")
	require.Zero(t, due+waiting)
	var actions []string
	for _, e := range pipelinetest.Audited(t, pool, "") {
		actions = append(actions, fmt.Sprint(e.Action, " ", e.Count))
	}
	require.Equal(t, []string{"outbox.retrying.retry-now 4", "outbox.failing.discard 2"}, actions)
}

// A group action under a filter acts within it (the confirm count is the
// page's, not the whole group's); logging in goes back to the page the
// operator was on (never to another site); logging out ends the session.
func TestGroupActionsKeepTheFilterAndLoginReturns(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	// One fingerprint, two handlers: 3 for payments.charge (setup), 2 more here.
	for g := 7; g <= 8; g++ {
		pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: fmt.Sprintf("x%d", g), Topic: "stripe.charge", Handler: "refunds.charge",
			Payload: "{}", Reason: fmt.Sprintf("gave up after 5 attempts: charging order %d: payment provider answered 503 from 10.0.0.%d", g, g)})
	}
	browser := newBrowser()

	// Not logged in, reading sends to the login form, which names the page
	// to come back to.
	resp, err := browser.Get(srv.URL + "/console/poison?handler=refunds.charge")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	_, page := get(t, browser, srv.URL+resp.Header.Get("Location"))
	unescaped := html.UnescapeString(between(page, `name="next" value="`, `"`))
	require.Equal(t, "/console/poison?handler=refunds.charge", unescaped)
	resp, err = browser.PostForm(srv.URL+"/console/login", url.Values{"token": {token}, "next": {unescaped}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, "/console/poison?handler=refunds.charge", resp.Header.Get("Location"), "back to where the operator was")
	for _, evil := range []string{"https://evil.example/", "//evil.example/x", "/other/path", "/console/login"} {
		resp, err := browser.PostForm(srv.URL+"/console/login", url.Values{"token": {token}, "next": {evil}})
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, "/console/poison", resp.Header.Get("Location"), evil)
	}

	_, page = get(t, browser, srv.URL+"/console/poison?handler=refunds.charge")
	require.Contains(t, page, `id="select-all"`)
	require.Less(t, strings.Index(page, `class="actionbar"`), strings.Index(page, `id="records"`), "the action bar comes before the list")
	groupForm := page[strings.Index(page, `value="group"`):]
	groupForm = groupForm[:strings.Index(groupForm, "</form>")]
	require.Contains(t, groupForm, `name="handler" value="refunds.charge"`, "the group action carries the filter")
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "scope": {"group"}, "action": {"discard"},
		"fingerprint": {html.UnescapeString(between(groupForm, `name="fingerprint" value="`, `"`))}, "handler": {"refunds.charge"}}
	resp, err = browser.PostForm(srv.URL+"/console/actions", form)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(body), `<b id="count">2</b>`, "the page showed 2 under the filter; the group has 5")

	resp, err = browser.PostForm(srv.URL+"/console/logout", url.Values{"csrf": {form.Get("csrf")}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	resp, err = browser.Get(srv.URL + "/console/poison")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode, "logged out, the console is not read")
	require.True(t, strings.HasPrefix(resp.Header.Get("Location"), "/console/login"))
}

// A failing outbox row has a page of its own (the whole last error, the
// payload, the headers) with "retry now" and "discard" for it alone.
func TestFailingRowDetailAndItsActions(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	ctx := context.Background()
	inAnHour := time.Now().Add(time.Hour)
	ids := pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{MessageUUID: "u-1", AggregateID: "o-1", Topic: "stripe.charge", Payload: `{"amount":5}`, Headers: map[string]string{"tenant_id": "acme"},
			Attempts: 4, LastError: "publishing: " + strings.Repeat("x", 300) + " END", AvailableAt: inAnHour},
		pipelinetest.OutboxRow{AggregateID: "o-2", Topic: "stripe.charge", Attempts: 4, LastError: "publishing: same", AvailableAt: inAnHour})
	id, other := ids[0], ids[1]
	browser := loggedIn(t, srv)

	_, list := get(t, browser, srv.URL+"/console/failing")
	require.Contains(t, list, `/console/failing/`+itoa(id)+`"`)
	code, page := get(t, browser, srv.URL+"/console/failing/"+itoa(id))
	require.Equal(t, 200, code)
	require.Contains(t, page, " END", "the last error whole")
	require.Contains(t, page, "&#34;amount&#34;: 5", "the payload, pretty")
	require.Contains(t, page, "acme")
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "kind": {"failing"}, "scope": {"selected"}, "id": {itoa(id)}, "action": {"retry-now"}}
	_, body := postForm(t, browser, srv.URL+"/console/outbox-actions", form)
	require.Contains(t, body, `<b id="count">1</b>`)
	withConfirmation(form, body)
	code, _ = postForm(t, browser, srv.URL+"/console/outbox-actions", form)
	require.Equal(t, http.StatusSeeOther, code)
	rows, err := testTable.Rows(ctx, pool, pgoutbox.RowFilter{IDs: []int64{id, other}})
	require.NoError(t, err)
	require.Len(t, rows, 2)
	require.False(t, rows[0].AvailableAt.After(time.Now()), "the row is due now")
	require.True(t, rows[1].AvailableAt.After(time.Now()), "only the row acted on")
	code, _ = get(t, browser, srv.URL+"/console/failing/999999")
	require.Equal(t, http.StatusNotFound, code)
}

// A poisoned message's detail page acts on that message alone.
func TestPoisonDetailActsOnItsMessage(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison/2")
	require.Contains(t, page, `id="detail-discard"`)
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "scope": {"selected"}, "id": {"2"}, "action": {"discard"}}
	_, body := postForm(t, browser, srv.URL+"/console/actions", form)
	require.Contains(t, body, `<b id="count">1</b>`)
	withConfirmation(form, body)
	postForm(t, browser, srv.URL+"/console/actions", form)
	require.NotContains(t, pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{}), int64(2))
	require.Equal(t, 4, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}), "the others stay")
}

// postForm posts form as the browser c would and returns the status and
// the page.
func postForm(t *testing.T, c *http.Client, u string, form url.Values) (int, string) {
	t.Helper()
	resp, err := c.PostForm(u, form)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// newBrowser is an HTTP client that keeps cookies and does not follow
// redirects, as a test reads them.
func newBrowser() *http.Client {
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// loggedIn is newBrowser after logging in with the admin token.
func loggedIn(t *testing.T, srv *httptest.Server) *http.Client {
	t.Helper()
	browser := newBrowser()
	resp, err := browser.PostForm(srv.URL+"/console/login", url.Values{"token": {token}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	return browser
}

// The overview draws the last hour from the processes' samples, and says
// what each chart shows to those who cannot see it.
func TestOverviewChartsTheLastHour(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	browser := loggedIn(t, srv)
	_, body := get(t, browser, srv.URL+"/console/")
	require.Contains(t, body, `id="no-samples"`, "with no process sampling, the overview says why the charts are empty")
	require.Contains(t, body, "no data in the last hour", "an empty chart draws no line at zero")
	require.NotContains(t, between(body, `<div class="charts" id="charts">`, `</div>`), "<polyline")

	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO ferry_samples (instance_id, at, counters) VALUES
		('r1', now() - interval '20 minutes', '{"dispatched": 0, "handled": 0, "failed": 0, "pending": 12}'),
		('r1', now() - interval '19 minutes', '{"dispatched": 1200, "handled": 600, "failed": 60, "pending": 340, "latency_le": {"0.01": 1200, "+Inf": 1200}}')`)
	require.NoError(t, err)
	_, body = get(t, browser, srv.URL+"/console/")
	require.NotContains(t, body, `id="no-samples"`)
	charts := between(body, `<div class="charts" id="charts">`, `</div>`)
	for _, want := range []string{
		`id="chart-depth"`, `aria-label="Outbox depth, last hour: pending latest 340 rows, highest 340 rows"`,
		`aria-label="Dispatched, last hour: dispatched latest 20.0 /s, highest 20.0 /s"`,
		`aria-label="Handlers, last hour: handled latest 10.0 /s, highest 10.0 /s; failed latest 1.0 /s, highest 1.0 /s"`,
		`points="210.2,89.5 215.5,22.0"`, // the depth: 12, then 340 at the top
	} {
		require.Contains(t, charts, want)
	}
	require.Contains(t, charts, `Dispatch latency p95, last hour: p95 latest 0.0095 s`, "1,200 dispatches under 10 ms: p95 interpolated in the first bucket")
	_, partial := get(t, browser, srv.URL+"/console/overview")
	require.Contains(t, partial, `id="chart-handlers"`, "the refreshed part redraws the charts")
}

// A bulk action does exactly what was confirmed (issue 33): a group that
// grows between the confirmation and the click is acted on only as far as
// it was shown; one confirmation takes at most MaxBackgroundRows, the
// oldest, and says how many the group holds; over MaxActionRows it runs as
// a background job whose page shows progress and result; posting the same
// confirmation again starts nothing and says so; the audit keeps the ids;
// the discard is undone from the job's page.
func TestBulkActionsDoExactlyWhatWasConfirmed(t *testing.T) {
	t.Parallel()
	const capRows = console.MaxActionRows + 200
	srv, pool := setupWith(t, func(c *console.Config) { c.MaxBackgroundRows = capRows })
	insert := func(from, to int) {
		t.Helper()
		var rows []pipelinetest.PoisonRow
		for g := from; g <= to; g++ {
			rows = append(rows, pipelinetest.PoisonRow{MessageID: fmt.Sprint("bulk-", g), Topic: "bulk.topic", Handler: "bulk.handler", Reason: fmt.Sprint("bulk failure ", g)})
		}
		pipelinetest.InsertPoison(t, pool, rows...)
	}
	left := func() (n int, first string) {
		t.Helper()
		left := pipelinetest.Poisoned(t, pool, pgpoison.Filter{Handler: "bulk.handler"})
		if len(left) > 0 {
			first = left[0].MessageID
		}
		return len(left), first
	}
	insert(1, capRows+5)
	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison?handler=bulk.handler")
	fp := pipelinetest.Poisoned(t, pool, pgpoison.Filter{MessageID: "bulk-1"})[0].Fingerprint
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "action": {"discard"}, "scope": {"group"}, "fingerprint": {fp}, "handler": {"bulk.handler"}}
	code, body := postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, fmt.Sprintf(`<b id="count">%d</b>`, capRows))
	require.Contains(t, body, fmt.Sprintf(`<span id="total">%d</span>`, capRows+5))
	require.Contains(t, body, `id="background"`, "the confirmation says it runs in the background")

	insert(capRows+6, capRows+10) // the group grows meanwhile
	withConfirmation(form, body)
	resp, err := browser.PostForm(srv.URL+"/console/actions", form)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	jobURL := resp.Header.Get("Location")
	require.Regexp(t, `^/console/jobs/\d+$`, jobURL, "the click answers at once, with the job's page")
	var job string
	require.Eventually(t, func() bool {
		_, job = get(t, browser, srv.URL+jobURL)
		return strings.Contains(job, `<b id="job-state">done</b>`)
	}, 60*time.Second, 100*time.Millisecond)
	require.Contains(t, job, fmt.Sprintf("discarded %d message(s)", capRows))
	require.Contains(t, job, fmt.Sprintf(`%d of %d`, capRows, capRows))
	n, first := left()
	require.Equal(t, 10, n, "the ones shown went; the 5 beyond the cap and the 5 that arrived after the confirmation stay")
	require.Equal(t, fmt.Sprintf("bulk-%d", capRows+1), first, "the oldest were taken")

	code, body = postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusConflict, code, "the same confirmation again: %s", body)
	require.Contains(t, body, "already")
	n, _ = left()
	require.Equal(t, 10, n, "nothing was done a second time")

	discards := pipelinetest.Audited(t, pool, "poison.discard")
	entries, ids := len(discards), 0
	for _, e := range discards {
		listed, _ := e.Detail["ids"].([]any)
		ids += len(listed)
	}
	require.Equal(t, capRows, ids, "the audit keeps every id discarded")
	require.Equal(t, 3, entries, "one entry per page of 500, each in its page's transaction")

	// Undo, from the job's page (the audit log offers it too, once per
	// run): the whole run comes back, with its ids.
	require.Contains(t, job, `id="undo"`)
	_, audit := get(t, browser, srv.URL+"/console/audit")
	require.Equal(t, 1, strings.Count(audit, `name="run" value="`+between(job, `name="run" value="`, `"`)+`"`), "one Undo for the run's three entries")
	// The undo asks first, with the count, and over MaxActionRows runs as
	// a job of its own, a page of 500 at a time.
	code, body = postForm(t, browser, srv.URL+"/console/undo", url.Values{"csrf": {form.Get("csrf")}, "run": {between(job, `name="run" value="`, `"`)}})
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, fmt.Sprintf(`<b id="count">%d</b>`, capRows))
	n, _ = left()
	require.Equal(t, 10, n, "asking put nothing back")
	resp, err = browser.PostForm(srv.URL+"/console/undo", hiddenFields(body))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Location"), "/console/jobs/")
	require.Eventually(t, func() bool {
		_, page := get(t, browser, srv.URL+resp.Header.Get("Location"))
		return strings.Contains(page, "put back 1200 message(s)")
	}, 30*time.Second, 50*time.Millisecond)
	n, first = left()
	require.Equal(t, capRows+10, n, "the discard was undone")
	require.Equal(t, "bulk-1", first)
	code, _ = postForm(t, browser, srv.URL+"/console/undo", url.Values{"csrf": {form.Get("csrf")}, "run": {between(job, `name="run" value="`, `"`)}})
	require.Equal(t, http.StatusConflict, code, "an undo works once")
	undone := 0
	for _, e := range pipelinetest.Audited(t, pool, "poison.undo") {
		require.NotContains(t, e.Detail, "ids", "an undo's audit counts, the discard's entries list the ids")
		undone += e.Count
	}
	require.Equal(t, capRows, undone)

	// The same for outbox rows: failing rows confirmed, more fail, the click.
	pipelinetest.InsertOutbox(t, pool, testTable, failingRows("f", 3)...)
	_, failing := get(t, browser, srv.URL+"/console/failing")
	oform := url.Values{"csrf": {between(failing, `name="csrf" value="`, `"`)}, "kind": {"failing"}, "action": {"retry-now"}, "scope": {"group"},
		"fingerprint": {html.UnescapeString(between(failing, `name="fingerprint" value="`, `"`))}}
	code, body = postForm(t, browser, srv.URL+"/console/outbox-actions", oform)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="count">3</b>`)
	pipelinetest.InsertOutbox(t, pool, testTable, failingRows("g", 2)...)
	withConfirmation(oform, body)
	code, _ = postForm(t, browser, srv.URL+"/console/outbox-actions", oform)
	require.Equal(t, http.StatusSeeOther, code)
	due, waiting := dueRows(t, pool, "stripe.charge")
	require.Equal(t, 3, due, "the three confirmed are due")
	require.Equal(t, 2, waiting, "the two that failed after the confirmation wait for one of their own")
	code, _ = postForm(t, browser, srv.URL+"/console/outbox-actions", oform)
	require.Equal(t, http.StatusConflict, code)
}

// Sessions live on the server (issue 33): logging out ends the session, so
// a copy of its cookie kept anywhere acts no more; each session has its
// own form token, and a confirmation of one session is no good in another;
// the identity an authenticating proxy gives is what the audit records.
func TestLoggingOutEndsTheSessionAndTokensAreTheSessions(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	c, err := console.New(pool, store, console.Config{Token: token, OutboxTable: testTable, IdentityHeader: "X-Forwarded-Email", Logger: slog.New(failOnRenderError{t})})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/console/", c)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{Reason: "provider said no"}, pipelinetest.PoisonRow{Reason: "provider said no"},
		pipelinetest.PoisonRow{Reason: "provider said no"})

	login := func(email string) (*http.Client, string) {
		t.Helper()
		browser := newBrowser()
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/console/login", strings.NewReader(url.Values{"token": {token}}.Encode()))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("X-Forwarded-Email", email)
		resp, err := browser.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusSeeOther, resp.StatusCode)
		_, page := get(t, browser, srv.URL+"/console/poison")
		return browser, between(page, `name="csrf" value="`, `"`)
	}
	alice, aliceCSRF := login("alice@example.com")
	bob, bobCSRF := login("bob@example.com")
	require.NotEqual(t, aliceCSRF, bobCSRF, "each session has its own form token")

	id := pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{})[0]
	form := url.Values{"csrf": {aliceCSRF}, "action": {"discard"}, "scope": {"selected"}, "id": {strconv.FormatInt(id, 10)}}
	code, body := postForm(t, alice, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusOK, code, body)
	withConfirmation(form, body)

	// Bob cannot use Alice's confirmation, nor her form token.
	bobForm := url.Values{}
	for k, v := range form {
		bobForm[k] = v
	}
	bobForm.Set("csrf", bobCSRF)
	code, body = postForm(t, bob, srv.URL+"/console/actions", bobForm)
	require.Equal(t, http.StatusOK, code, "another session's confirmation only asks again: %s", body)
	code, _ = postForm(t, bob, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusForbidden, code, "another session's form token")

	// Alice keeps a copy of her cookie, logs out, and the copy acts no more.
	kept := newBrowser()
	u, _ := url.Parse(srv.URL + "/console/")
	kept.Jar.SetCookies(u, alice.Jar.Cookies(u))
	code, _ = postForm(t, alice, srv.URL+"/console/logout", url.Values{"csrf": {aliceCSRF}})
	require.Equal(t, http.StatusSeeOther, code)
	code, _ = postForm(t, kept, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusUnauthorized, code, "the session ended on the server")
	require.Equal(t, 3, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}), "nothing was discarded after logging out")

	// Bob's own confirmation works, and the audit names him.
	bobForm = url.Values{"csrf": {bobCSRF}, "action": {"discard"}, "scope": {"selected"}, "id": {strconv.FormatInt(id, 10)}}
	_, body = postForm(t, bob, srv.URL+"/console/actions", bobForm)
	withConfirmation(bobForm, body)
	code, _ = postForm(t, bob, srv.URL+"/console/actions", bobForm)
	require.Equal(t, http.StatusSeeOther, code)
	discards := pipelinetest.Audited(t, pool, "poison.discard")
	require.Len(t, discards, 1)
	require.Contains(t, discards[0].Actor, "bob@example.com")
}

// The search page finds a message across the stores by aggregate, message
// or correlation id, and says where it is now.
func TestSearchPageSaysWhereAMessageIs(t *testing.T) {
	t.Parallel()
	srv, _ := setup(t)
	browser := loggedIn(t, srv)
	code, body := get(t, browser, srv.URL+"/console/search?q=order-2")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "Message <code>m2</code>")
	require.Contains(t, body, "in the poison store")
	require.Contains(t, body, `href="/console/poison/`)
	code, body = get(t, browser, srv.URL+"/console/search?q=m3")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "Message <code>m3</code>")
	code, body = get(t, browser, srv.URL+"/console/search?q=nothing-here")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="nothing"`)

	// Each item of "needs attention" links the page to act on it from.
	_, body = get(t, browser, srv.URL+"/console/")
	require.Contains(t, between(body, `<ul id="attention">`, `</ul>`), `<a href="/console/poison">`)
}
