package console_test

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/html"

	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/tenancy"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The console of a tenant fleet: a tenants page with each tenant's state
// and what needs a human, Pause and Resume behind a confirmation (audited,
// as ferry tenants pause does), and the overview's item naming the tenant
// that needs a human, linked to the page.
func TestTenantsPageShowsEachTenantAndPausesOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var control *pgxpool.Pool
	srv, pool := setupWith(t, func(cfg *console.Config) {
		cfg.Tenants = func(ctx context.Context) ([]tenancy.Status, error) {
			ts, err := pgtenants.List(ctx, control)
			if err != nil {
				return nil, err
			}
			store, err := pgpoison.NewStore(control, pipelinetest.Outbox(t))
			if err != nil {
				return nil, err
			}
			rows, _, err := tenancy.Statuses(ctx, control, tenancy.StatusConfig{ControlURL: pipelinetest.DatabaseURL(), Outbox: testTable, Poison: store, Timeout: 5 * time.Second}, ts)
			return rows, err
		}
	})
	control = pool
	// acme: a database that answers, with nothing waiting; ghost: a
	// server that does not answer.
	acme := pipelinetest.Schema(t)
	require.NoError(t, pgtenants.Add(ctx, pool, pgtenants.Tenant{ID: "acme", DatabaseURL: pipelinetest.DatabaseURL(), Schema: acme}, "test"))
	require.NoError(t, pgtenants.Add(ctx, pool, pgtenants.Tenant{ID: "ghost", DatabaseURL: "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=2", Schema: "public"}, "test"))

	browser := loggedIn(t, srv)
	code, body := get(t, browser, srv.URL+"/console/tenants")
	require.Equal(t, 200, code, body)
	require.Contains(t, body, "2 tenant(s), 2 need a human")
	require.Contains(t, body, "its database is out of reach")
	require.Contains(t, body, "no fleet member alive")
	require.Contains(t, body, `aria-label="Pause tenant acme"`)
	doc, err := html.Parse(strings.NewReader(body))
	require.NoError(t, err)
	require.Empty(t, unnamed(doc))

	// The overview: its first read starts in the background; once done,
	// the item names both and links the page.
	require.Eventually(t, func() bool {
		_, body := get(t, browser, srv.URL+"/console/overview")
		return strings.Contains(body, "2 tenant(s) need a human: acme (") && strings.Contains(body, `href="/console/tenants"`)
	}, 30*time.Second, 200*time.Millisecond)

	csrf := between(body, `name="csrf" value="`, `"`)
	form := url.Values{"csrf": {csrf}, "tenant": {"acme"}, "action": {"pause"}, "reason": {"moving its database"}}
	noRedirect := &http.Client{Jar: browser.Jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	post := func(form url.Values) (*http.Response, string) {
		resp, err := noRedirect.PostForm(srv.URL+"/console/tenant-actions", form)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, string(b)
	}
	resp, page := post(form)
	require.Equal(t, 200, resp.StatusCode)
	require.Contains(t, page, "This will pause tenant acme")
	tn, err := pgtenants.Get(ctx, pool, "acme")
	require.NoError(t, err)
	require.False(t, tn.Paused, "the confirmation changes nothing")
	for _, k := range []string{"asked_at", "confirm"} {
		form.Set(k, between(page, `name="`+k+`" value="`, `"`))
	}
	other := url.Values{}
	for k, v := range form {
		other[k] = v
	}
	other.Set("tenant", "ghost")
	resp, _ = post(other)
	require.Equal(t, 200, resp.StatusCode, "a confirmation is bound to the tenant it was given for")
	resp, _ = post(form)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	tn, err = pgtenants.Get(ctx, pool, "acme")
	require.NoError(t, err)
	require.True(t, tn.Paused)
	require.Equal(t, "moving its database", tn.Reason)
	audit := pipelinetest.Audited(t, pool, pgtenants.PauseAction)
	require.Len(t, audit, 1)
	require.Contains(t, audit[0].Actor, "console")
	_, body = get(t, browser, srv.URL+"/console/tenants")
	require.Contains(t, body, "paused by")
	require.Contains(t, body, `aria-label="Resume tenant acme"`)

	resp, _ = post(url.Values{"csrf": {csrf}, "tenant": {"Not Valid"}, "action": {"pause"}})
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
}

// A console without a fleet has no tenants page.
func TestTenantsPageNeedsAFleet(t *testing.T) {
	t.Parallel()
	srv, _ := setup(t)
	browser := loggedIn(t, srv)
	code, body := get(t, browser, srv.URL+"/console/tenants")
	require.Equal(t, http.StatusNotFound, code)
	require.Contains(t, body, "no tenant fleet")
	_, body = get(t, browser, srv.URL+"/console/")
	require.NotContains(t, body, "/console/tenants")
}
