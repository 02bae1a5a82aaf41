package console_test

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A confirmation of failing rows binds the rows it showed: an older row
// that fails with the same error after the preview joins the group, and
// the discard still deletes exactly the rows shown (it took "id <= the
// newest shown, oldest first, as many as shown": the older row, and left
// a shown one).
func TestAnOlderRowJoiningAConfirmedGroupIsLeftAlone(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	ctx := context.Background()
	// The older row is pending (no error yet); three newer rows fail.
	older := pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{AggregateID: "old", Topic: "stripe.charge",
		AvailableAt: time.Now().Add(10 * time.Minute)})[0]
	shownIDs := pipelinetest.InsertOutbox(t, pool, testTable, failingRows("f", 3)...)
	browser := loggedIn(t, srv)
	_, failing := get(t, browser, srv.URL+"/console/failing")
	form := url.Values{"csrf": {between(failing, `name="csrf" value="`, `"`)}, "kind": {"failing"}, "action": {"discard"}, "scope": {"group"},
		"fingerprint": {html.UnescapeString(between(failing, `name="fingerprint" value="`, `"`))}}
	code, body := postForm(t, browser, srv.URL+"/console/outbox-actions", form)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="count">3</b>`)
	// Now the older row fails with the same error: it joins the group.
	_, err := pool.Exec(ctx, `UPDATE `+outboxSQL+` SET attempts = 3, last_error = 'publishing to exchange x: NOT_FOUND' WHERE id = $1`, older)
	require.NoError(t, err)
	withConfirmation(form, body)
	code, _ = postForm(t, browser, srv.URL+"/console/outbox-actions", form)
	require.Equal(t, http.StatusSeeOther, code)
	rows, err := testTable.Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	var left []int64
	for _, r := range rows {
		left = append(left, r.ID)
	}
	require.Equal(t, []int64{older}, left, "the three shown (%v) are gone, the older row nobody saw stays", shownIDs)
}

// An Undo between the preview and the click puts messages back under
// their old, lower ids: the confirmation still acts on the ids it showed
// (it acted on the oldest "as many as shown" up to the newest shown, which
// were the restored ones).
func TestAnUndoBetweenPreviewAndClickChangesNothing(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	ctx := context.Background()
	var rows []pipelinetest.PoisonRow
	for g := 1; g <= 10; g++ {
		rows = append(rows, pipelinetest.PoisonRow{MessageID: fmt.Sprint("u", g), Handler: "undo.handler", Reason: "provider said no"})
	}
	ids := pipelinetest.InsertPoison(t, pool, rows...)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	// The five oldest are discarded: the handler's group holds the rest.
	_, err = store.DiscardEach(ctx, pgpoison.Selector{IDs: ids[:5]}, pgpoison.Run{Actor: "test", ID: "run-undo"}, func(pgpoison.Action) error { return nil })
	require.NoError(t, err)

	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison?handler=undo.handler")
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "action": {"discard"}, "scope": {"filter"}, "handler": {"undo.handler"}}
	code, body := postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<b id="count">5</b>`)
	// Another operator undoes the earlier discard: five messages come back
	// under their old, lower ids.
	_, err = store.Undo(ctx, "run-undo", "other@test")
	require.NoError(t, err)
	withConfirmation(form, body)
	code, _ = postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, ids[:5], pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{Handler: "undo.handler"}), "the restored messages stay; the five shown went")
}

// Two filters whose old text was one ("aggregate=A,text=T") get different
// confirmations and different audit entries.
func TestFilterSpellingsHaveTheirOwnConfirmation(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	pipelinetest.InsertPoison(t, pool,
		pipelinetest.PoisonRow{MessageID: "x1", Handler: "spell.h", AggregateID: "A,text=T", Reason: "r"},
		pipelinetest.PoisonRow{MessageID: "x2", Handler: "spell.h", AggregateID: "A", Reason: "T"})
	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison")
	csrf := between(page, `name="csrf" value="`, `"`)
	preview := func(f url.Values) (url.Values, string) {
		form := url.Values{"csrf": {csrf}, "action": {"discard"}, "scope": {"filter"}}
		for k, v := range f {
			form[k] = v
		}
		code, body := postForm(t, browser, srv.URL+"/console/actions", form)
		require.Equal(t, http.StatusOK, code, body)
		require.Contains(t, body, `<b id="count">1</b>`, body)
		return form, body
	}
	one, oneBody := preview(url.Values{"aggregate": {"A,text=T"}})
	two, twoBody := preview(url.Values{"aggregate": {"A"}, "text": {"T"}})
	// The first filter's confirmation does not confirm the second.
	withConfirmation(two, oneBody)
	code, body := postForm(t, browser, srv.URL+"/console/actions", two)
	require.Equal(t, http.StatusOK, code, "shown a preview again, nothing done: %s", body)
	require.Equal(t, 2, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{Handler: "spell.h"}))
	withConfirmation(one, oneBody)
	code, _ = postForm(t, browser, srv.URL+"/console/actions", one)
	require.Equal(t, http.StatusSeeOther, code)
	withConfirmation(two, twoBody)
	code, _ = postForm(t, browser, srv.URL+"/console/actions", two)
	require.Equal(t, http.StatusSeeOther, code)
	var scopes []string
	for _, e := range pipelinetest.Audited(t, pool, "poison.discard") {
		scopes = append(scopes, e.Scope)
	}
	require.Len(t, scopes, 2)
	require.NotEqual(t, scopes[0], scopes[1], "the audit tells the two apart")
}

// Every filter the console offers can be previewed and acted on: a
// correlation id or a message id alone counted on the confirmation page,
// then answered 500.
func TestEveryFilterTheConsoleOffersActs(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	pipelinetest.InsertPoison(t, pool,
		pipelinetest.PoisonRow{MessageID: "c-only", Handler: "f.h", CorrelationID: "corr-9", Reason: "r"},
		pipelinetest.PoisonRow{MessageID: "m-only", Handler: "f.h", Reason: "r"})
	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison")
	csrf := between(page, `name="csrf" value="`, `"`)
	for _, f := range []url.Values{{"correlation": {"corr-9"}}, {"message": {"m-only"}}, {"since": {"1h"}, "handler": {"nobody"}}} {
		form := url.Values{"csrf": {csrf}, "action": {"discard"}, "scope": {"filter"}}
		for k, v := range f {
			form[k] = v
		}
		code, body := postForm(t, browser, srv.URL+"/console/actions", form)
		require.Equal(t, http.StatusOK, code, "%v: %s", f, body)
		// The browser posts the confirmation page's form: since=1h comes
		// back as the time it meant at the preview.
		code, body = postForm(t, browser, srv.URL+"/console/actions", hiddenFields(body))
		require.Equal(t, http.StatusSeeOther, code, "%v: %s", f, body)
	}
	require.Zero(t, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{Handler: "f.h"}))
}

// A confirmation expires: past Config.ConfirmTTL it is refused, saying
// so, and nothing is done.
func TestAConfirmationExpires(t *testing.T) {
	t.Parallel()
	srv, pool := setupWith(t, func(c *console.Config) { c.ConfirmTTL = 300 * time.Millisecond })
	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison")
	form := url.Values{"csrf": {between(page, `name="csrf" value="`, `"`)}, "action": {"discard"}, "scope": {"filter"}, "handler": {"payments.charge"}}
	code, body := postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `<span id="ttl">300ms</span>`)
	time.Sleep(time.Second)
	withConfirmation(form, body)
	code, body = postForm(t, browser, srv.URL+"/console/actions", form)
	require.Equal(t, http.StatusConflict, code, body)
	require.Contains(t, body, "expired")
	require.Equal(t, 5, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{}))
	require.Empty(t, pipelinetest.Audited(t, pool, ""), "nothing done, nothing audited")
}

// hiddenFields is the form a confirmation page posts: its hidden inputs.
func hiddenFields(page string) url.Values {
	form := url.Values{}
	for _, part := range strings.Split(page, `<input type="hidden" name="`)[1:] {
		name, rest, _ := strings.Cut(part, `"`)
		value := between(rest, `value="`, `"`)
		form.Add(name, html.UnescapeString(value))
	}
	return form
}

// Searches run a few at once: while MaxSearches are running (here held
// behind a lock on the poison store), another is answered 429 at once
// instead of taking one more of the connections the consumers share.
func TestSearchesAreBoundedWhileTheyRun(t *testing.T) {
	t.Parallel()
	srv, pool := setupWith(t, func(c *console.Config) { c.MaxSearches = 2 })
	browser := loggedIn(t, srv)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `LOCK TABLE `+pgpoison.Table+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	codes := make(chan int, 2)
	for range 2 {
		go func() {
			code, _ := get(t, browser, srv.URL+"/console/search?q=order-1")
			codes <- code
		}()
	}
	require.Eventually(t, func() bool {
		var waiting int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass`, pgpoison.Table).Scan(&waiting)
		return waiting == 2
	}, 20*time.Second, 20*time.Millisecond, "two searches wait on the lock")
	code, body := get(t, browser, srv.URL+"/console/search?q=order-1")
	require.Equal(t, http.StatusTooManyRequests, code, body)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, http.StatusOK, <-codes)
	require.Equal(t, http.StatusOK, <-codes)
	code, _ = get(t, browser, srv.URL+"/console/search?q=order-1")
	require.Equal(t, http.StatusOK, code, "once they end, searching works again")
}

// The same action from the command line and from the console writes the
// same audit entry: action, scope and count, with the same ids; only who,
// from where, when and the console's confirmation differ.
func TestTheSameActionAuditsTheSameFromEveryFrontEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv, pool := setup(t)
	browser := loggedIn(t, srv)
	_, page := get(t, browser, srv.URL+"/console/poison")
	csrf := between(page, `name="csrf" value="`, `"`)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	for _, f := range []pgpoison.Filter{{Handler: "payments.charge", Text: "order 1"}, {Handler: "notifications.mail"}} {
		// The same selection twice over: requeue it from the console, let
		// it be poisoned again, then from the library call the CLI makes.
		before := pipelinetest.Poisoned(t, pool, f)
		form := url.Values{"csrf": {csrf}, "action": {"discard"}, "scope": {"filter"}}
		for k, v := range f.Values() {
			form[k] = v
		}
		code, body := postForm(t, browser, srv.URL+"/console/actions", form)
		require.Equal(t, http.StatusOK, code, body)
		code, _ = postForm(t, browser, srv.URL+"/console/actions", hiddenFields(body))
		require.Equal(t, http.StatusSeeOther, code)
		var rows []pipelinetest.PoisonRow
		for _, r := range before {
			rows = append(rows, pipelinetest.PoisonRow{MessageID: r.MessageID, Topic: r.Topic, Handler: r.Handler, AggregateID: r.AggregateID, Reason: r.Reason, Payload: "{}"})
		}
		pipelinetest.InsertPoison(t, pool, rows...)
		_, err = store.DiscardEach(ctx, pgpoison.Selector{Filter: f}, pgpoison.Run{Actor: "cli ops@host"}, func(pgpoison.Action) error { return nil })
		require.NoError(t, err)
	}
	entries := pipelinetest.Audited(t, pool, "poison.discard")
	require.Len(t, entries, 4)
	for i := 0; i < 4; i += 2 {
		console, cli := entries[i], entries[i+1]
		require.Equal(t, console.Scope, cli.Scope)
		require.Equal(t, console.Count, cli.Count)
		require.Len(t, cli.Detail["ids"], console.Count)
		require.Contains(t, console.Actor, "console")
		require.Equal(t, "cli ops@host", cli.Actor)
	}
}

// Readers see what they need: an outbox row's page shows only rows the
// failing and retrying pages list (it rendered any row, sent or not, with
// its payload), and the payload fields named in MaskFields are masked on
// every detail page.
func TestReadersSeeOnlyFailingRowsAndMaskedFields(t *testing.T) {
	t.Parallel()
	srv, pool := setupWith(t, func(c *console.Config) { c.MaskFields = []string{"card_holder", "Email"} })
	ids := pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{AggregateID: "sent", Topic: "t", Payload: `{"card_holder":"Erin"}`, Dispatched: true},
		pipelinetest.OutboxRow{AggregateID: "waiting", Topic: "t", Payload: `{"card_holder":"Erin"}`},
		pipelinetest.OutboxRow{AggregateID: "failing", Topic: "t", Payload: `{"order":{"card_holder":"Erin","email":"e@x","n":7}}`,
			Attempts: 2, LastError: "NOT_FOUND", AvailableAt: time.Now().Add(time.Hour)})
	browser := loggedIn(t, srv)
	for _, id := range ids[:2] {
		code, body := get(t, browser, srv.URL+"/console/failing/"+itoa(id))
		require.Equal(t, http.StatusNotFound, code)
		require.NotContains(t, body, "Erin")
	}
	code, body := get(t, browser, srv.URL+"/console/failing/"+itoa(ids[2]))
	require.Equal(t, http.StatusOK, code)
	require.NotContains(t, body, "Erin")
	require.NotContains(t, body, "e@x")
	require.Contains(t, body, "&lt;masked&gt;")
	require.Contains(t, body, "7", "the other fields stay")

	poisoned := pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{Payload: `{"card_holder":"Erin"}`, Reason: "r"},
		pipelinetest.PoisonRow{MessageID: "raw", Payload: "Erin's raw bytes", Reason: "r"})
	_, body = get(t, browser, srv.URL+"/console/poison/"+itoa(poisoned[0]))
	require.NotContains(t, body, "Erin")
	_, body = get(t, browser, srv.URL+"/console/poison/"+itoa(poisoned[1]))
	require.NotContains(t, body, "Erin", "not JSON: hidden whole")
}

// Each attention item of the overview links its runbook, the page the
// matching alert links.
func TestAttentionItemsLinkTheirRunbook(t *testing.T) {
	t.Parallel()
	srv, _ := setup(t)
	_, body := get(t, loggedIn(t, srv), srv.URL+"/console/")
	require.Contains(t, body, `class="runbook" href="https://github.com/ferry-dev/ferry/blob/main/docs/operations.md#runbook-ferrypoisonarriving"`)
}
