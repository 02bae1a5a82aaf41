package ordersapp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The console in a real headless Chromium (Debian's, installed by
// .ci/run): the overview with seeded data, a filter, a message's detail,
// a refused action without the token, then logged in: requeue a group
// after its dry-run count, see the rows handled and the audit entry.
// Hostile content in reasons and payloads renders as text.
func TestConsoleInAHeadlessBrowser(t *testing.T) {
	t.Parallel()
	chromium, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatalf("this test drives Debian's chromium (apt-get install chromium; .ci/run installs it): %v", err)
	}
	cfg, provider, sink := testConfig(t)
	cfg.AdminToken = "console-browser-token-0123"
	// The provider's outage lasts the whole test: the mails' durable
	// retries keep waiting (slow backoff, never given up) and the ordered
	// ledger's partition stays held behind its head.
	cfg.DurableRetry.MaxAttempts = 1000
	cfg.DurableRetry.Backoff = pipeline.Backoff{Initial: 3 * time.Second, Max: 5 * time.Second}
	var failing atomic.Bool
	failing.Store(true)
	var handled atomic.Int32
	outage := func(msg *message.Message) error {
		return fmt.Errorf("provider answered 503 for %s (outage)", pipeline.MessageID(msg))
	}
	h := startWith(t, cfg, provider, sink, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "flaky.charge", Topic: "work.flaky", Handler: func(msg *message.Message) error {
			if failing.Load() {
				return pipeline.Permanent(fmt.Errorf("charging %s: provider answered 503 from 10.1.2.3", pipeline.MessageID(msg)))
			}
			handled.Add(1)
			return nil
		}},
			{Name: "outage.mail", Topic: "work.outage-mail", Handler: outage},
			{Name: "outage.ledger", Topic: "work.outage-ledger", Ordered: true, Handler: outage}}, nil
	}}, app.Components{Relay: true, Consumers: true})
	for i := range 3 {
		publishEvent(t, h, "work.flaky", fmt.Sprintf("order-%d", i), map[string]int{"order_id": i})
		publishEvent(t, h, "work.outage-mail", fmt.Sprintf("order-%d", i), map[string]int{"order_id": i})
		publishEvent(t, h, "work.outage-ledger", "account-7", map[string]int{"entry": i})
	}
	eventually(t, "three poisoned", func() bool { return len(h.poisoned(t)) == 3 })
	evilID := pipelinetest.InsertPoison(t, h.app.Pool(), pipelinetest.PoisonRow{MessageID: "evil", Topic: "mail.send", Handler: "notifications.mail",
		Payload: `{"x":"<img src=x onerror=window.__pwned=1>"}`, Reason: "<script>window.__pwned=1</script> \x1b[2J owned"})[0]
	srv := httptest.NewServer(h.app.AdminHandler())
	defer srv.Close()
	shots := os.Getenv("FERRY_CONSOLE_SCREENSHOTS") // docs/ when refreshing the pictures of docs/operations.md
	if shots == "" {
		shots = t.TempDir()
	}

	// Chromium may still write its profile while it shuts down: its own
	// directory, removed with retries rather than by t.TempDir.
	profile, err := os.MkdirTemp("", "ferry-chromium-")
	require.NoError(t, err)
	t.Cleanup(func() {
		for range 50 {
			if os.RemoveAll(profile) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Errorf("could not remove the browser profile %s", profile)
	})
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.UserDataDir(profile), chromedp.WindowSize(1400, 900))
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelA()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	// A bound for a stuck browser, not a target: a CI run of the full
	// suite on a loaded machine took more than 5 minutes.
	ctx, cancelT := context.WithTimeout(ctx, 8*time.Minute)
	defer cancelT()
	run := func(what string, actions ...chromedp.Action) {
		t.Helper()
		require.NoError(t, chromedp.Run(ctx, actions...), what)
	}
	shot := func(name string) chromedp.Action {
		return chromedp.ActionFunc(func(ctx context.Context) error {
			var png []byte
			if err := chromedp.FullScreenshot(&png, 100).Do(ctx); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(shots, name), png, 0o644)
		})
	}

	// Not logged in, the console shows nothing but its login form (a proxy
	// or a tunnel on the host would make any reader look local); logging in
	// goes back to the page asked for.
	var loginURL string
	run("login first", chromedp.Navigate(srv.URL+"/console/"), chromedp.WaitVisible("#token"), chromedp.Location(&loginURL))
	require.Contains(t, loginURL, "/console/login?next=")
	var pending, poisonTotal string
	run("overview", chromedp.SendKeys("#token", cfg.AdminToken), chromedp.Click("#login"), chromedp.WaitVisible("#pending"),
		chromedp.Text("#poison-total", &poisonTotal), chromedp.Text("#pending", &pending), shot("console-overview.png"))
	require.Equal(t, "4", strings.TrimSpace(poisonTotal))

	// During the provider's outage the overview says where messages wait:
	// the mails retrying (with why), the ledger's partition held behind
	// its head (since when, which message, why), both under "needs
	// attention".
	eventually(t, "mails retrying and the ledger's partition held", func() bool {
		rep, err := pgstatus.Collect(context.Background(), h.app.Pool(), pgoutbox.Table{}, pgstatus.DefaultAttemptsThreshold)
		return err == nil && rep.RetryingTotal == 3 && len(rep.Held) == 1
	})
	var retrying, held, attention string
	// A retry in flight (delivered, failing again) is not waiting in the
	// outbox for a moment every few seconds: look until a page shows all.
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := chromedp.Run(ctx, chromedp.Navigate(srv.URL+"/console/"), chromedp.WaitVisible("#attention"),
			chromedp.Evaluate(`(document.querySelector("#overview-retrying")||{}).innerText||""`, &retrying),
			chromedp.Evaluate(`(document.querySelector("#held")||{}).innerText||""`, &held),
			chromedp.Text("#attention", &attention))
		if err == nil && strings.Contains(retrying, "outage.mail") && strings.Contains(held, "outage.ledger@") && strings.Contains(attention, "3 message(s) retrying") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the overview never showed the outage (last error %v): retrying %q, held %q, attention %q", err, retrying, held, attention)
		}
		time.Sleep(200 * time.Millisecond)
	}
	run("outage screenshot", shot("console-outage.png"))

	// Auto-refresh keeps keyboard focus: a link inside the refreshing
	// overview keeps it across a refresh.
	var swaps int
	var focused string
	run("focus a link of the overview", chromedp.Evaluate(`window.__swaps = 0; document.addEventListener("htmx:afterSettle", () => window.__swaps++);
		document.querySelector("#held a.held-link").focus(); document.activeElement.getAttribute("href")`, &focused))
	require.Contains(t, focused, "/console/held/outage.ledger@")
	deadline = time.Now().Add(30 * time.Second)
	for swaps < 2 && time.Now().Before(deadline) {
		time.Sleep(500 * time.Millisecond)
		run("count refreshes", chromedp.Evaluate(`window.__swaps`, &swaps))
	}
	require.GreaterOrEqual(t, swaps, 2, "the overview refreshed")
	var still string
	run("focus after the refresh", chromedp.Evaluate(`(document.activeElement && document.activeElement.getAttribute("href")) || document.activeElement.tagName`, &still))
	require.Equal(t, focused, still, "the focused link still has focus after the refresh")

	// The held head's own page, from the overview's link: its payload, its
	// error, how many wait behind it, and Retry now (logged in).
	var heldPage, behind string
	// Clicked in the page: the overview swaps its content every 5 s, and a
	// node found before a swap is gone after it.
	run("held head page", chromedp.Evaluate(`document.querySelector("#held a.held-link").click()`, nil), chromedp.WaitVisible("#held-summary"),
		chromedp.Text("main", &heldPage), chromedp.Text("#held-summary", &behind), shot("console-held.png"))
	require.Contains(t, heldPage, "provider answered 503 for")
	require.Contains(t, heldPage, `"entry": 0`, "the head's payload")
	require.Contains(t, behind, "message(s) wait behind it")
	var retried string
	run("retry now", chromedp.Click("#retry-now", chromedp.NodeVisible), chromedp.WaitVisible("#confirm-count"),
		chromedp.Click("#confirm", chromedp.NodeVisible), chromedp.WaitVisible("#flash"), chromedp.Text("#flash", &retried))
	require.Contains(t, retried, "again now")

	// Where is this message? The account's three ledger entries: the head
	// holding its partition, the two waiting behind it at the broker.
	var results string
	run("search", chromedp.Navigate(srv.URL+"/console/search"), chromedp.WaitVisible("#q"), chromedp.SendKeys("#q", "account-7"),
		chromedp.Click("#find"), chromedp.WaitVisible("#results"), chromedp.Text("#results", &results), shot("console-search.png"))
	require.Equal(t, 3, strings.Count(results, "Message "), results)
	require.Contains(t, results, "holding its partition")
	require.Equal(t, 2, strings.Count(results, "waiting at the broker behind the held head"), results)
	require.Contains(t, retrying, "outage.mail")
	require.Contains(t, retrying, "provider answered 503 for")
	require.Contains(t, held, "outage.ledger@")
	require.Contains(t, held, "provider answered 503 for")
	require.Contains(t, attention, "3 message(s) retrying")
	require.Contains(t, attention, "held")

	var records, groups string
	run("filter", chromedp.Navigate(srv.URL+"/console/poison"), chromedp.WaitVisible("#filter"),
		chromedp.SendKeys("#f-handler", "flaky.charge"), chromedp.Click("#apply-filter"))
	// The filtered page replaces the one clicked on: read until the new
	// #records is there (a node read mid-swap is gone before its text is).
	deadline = time.Now().Add(30 * time.Second)
	for {
		err := chromedp.Run(ctx, chromedp.Text("#records", &records, chromedp.NodeVisible), chromedp.Text("#groups", &groups, chromedp.NodeVisible))
		if err == nil && strings.Count(records, "flaky.charge") == 3 && !strings.Contains(records, "notifications.mail") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the filtered list never showed (last error %v): %s", err, records)
		}
		time.Sleep(50 * time.Millisecond)
	}
	run("filter screenshot", shot("console-poison.png"))
	require.Contains(t, groups, "provider answered 503 from <ip>", "the status code stays in the fingerprint, the address goes")

	var payload string
	run("detail", chromedp.Click("a.detail", chromedp.NodeVisible), chromedp.WaitVisible("#payload"), chromedp.Text("#payload", &payload))
	require.Contains(t, payload, "order_id")

	// Hostile content is text, never markup.
	var hostile string
	var pwned bool
	run("hostile", chromedp.Navigate(srv.URL+"/console/poison?handler=notifications.mail"), chromedp.WaitVisible("#records"),
		chromedp.Text("#records", &hostile), chromedp.Click("a.detail", chromedp.NodeVisible), chromedp.WaitVisible("#payload"),
		chromedp.Evaluate(`window.__pwned === 1`, &pwned))
	require.Contains(t, hostile, "<script>window.__pwned=1</script>")
	require.NotContains(t, hostile, "\x1b")
	require.False(t, pwned, "no script or handler from the data ran")

	// Logged out, the session is over: the console asks for a login again
	// and nothing changed.
	run("log out", chromedp.Navigate(srv.URL+"/console/poison?handler=flaky.charge"), chromedp.WaitVisible("#groups"),
		chromedp.Click("#logout", chromedp.NodeVisible), chromedp.WaitVisible("#token"),
		chromedp.Navigate(srv.URL+"/console/poison?handler=flaky.charge"), chromedp.WaitVisible("#token"))
	require.Len(t, h.poisoned(t), 4)

	// Logged in: the dry-run count, then the requeue of the group.
	failing.Store(false)
	var count, flash string
	run("requeue", chromedp.SendKeys("#token", cfg.AdminToken), chromedp.Click("#login"), chromedp.WaitVisible("#groups"),
		chromedp.Click("button.requeue-group", chromedp.NodeVisible), chromedp.WaitVisible("#count"), chromedp.Text("#count", &count))
	require.Equal(t, "3", count, "the count comes first")
	require.Len(t, h.poisoned(t), 4, "the confirmation page changed nothing")
	run("confirm", chromedp.Click("#confirm"), chromedp.WaitVisible("#flash"), chromedp.Text("#flash", &flash))
	require.Contains(t, flash, "requeued 3 message(s)")
	eventually(t, "the requeued messages handled", func() bool { return handled.Load() == 3 })
	require.Len(t, h.poisoned(t), 1, "only the hostile one is left")

	var audit string
	run("audit", chromedp.Navigate(srv.URL+"/console/audit"), chromedp.WaitVisible("#audit"), chromedp.Text("#audit", &audit))
	require.Contains(t, audit, "poison.requeue")
	require.Contains(t, audit, "fingerprint=", "the group, in the selection's canonical words (as the command line's)")

	// An action from a message's detail page: discard the hostile one,
	// after its count.
	run("detail action", chromedp.Navigate(fmt.Sprintf("%s/console/poison/%d", srv.URL, evilID)), chromedp.WaitVisible("#detail-discard"),
		shot("console-detail.png"), chromedp.Click("#detail-discard"), chromedp.WaitVisible("#count"), chromedp.Text("#count", &count))
	require.Equal(t, "1", strings.TrimSpace(count))
	require.Len(t, h.poisoned(t), 1, "the count changed nothing")
	run("confirm detail action", chromedp.Click("#confirm"), chromedp.WaitVisible("#flash"), chromedp.Text("#flash", &flash))
	require.Contains(t, flash, "discarded 1 message(s)")
	require.Empty(t, h.poisoned(t))

	// Paging under a filter: 120 mails behind the filter, pages of 50; the
	// third page holds the oldest 20 and the filter is still applied.
	poisonMany(t, h, "bulk-", "mail.send", "bulk.mail", "SMTP 451 for mail ", 120)
	poisonMany(t, h, "sms-", "sms.send", "bulk.sms", "SMTP 451 for mail ", 30)
	var pager, handlerField, third string
	run("page 1 under a filter", chromedp.Navigate(srv.URL+"/console/poison"), chromedp.WaitVisible("#filter"),
		chromedp.SendKeys("#f-handler", "bulk.mail"), chromedp.Click("#apply-filter"))
	deadline = time.Now().Add(30 * time.Second)
	for {
		err := chromedp.Run(ctx, chromedp.Text(".pager", &pager, chromedp.NodeVisible))
		if err == nil && strings.Contains(pager, "of 120") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the filtered first page never showed (last error %v): %s", err, pager)
		}
		time.Sleep(50 * time.Millisecond)
	}
	run("page 2", chromedp.Click("#next", chromedp.NodeVisible), chromedp.WaitVisible("#newer"))
	run("page 3", chromedp.Click("#next", chromedp.NodeVisible), chromedp.WaitNotPresent("#next"),
		chromedp.Text(".pager", &pager), chromedp.Value("#f-handler", &handlerField), chromedp.Text("#records", &third), shot("console-page-3.png"))
	require.Contains(t, pager, "20 shown of 120", "page 3 holds the oldest 20")
	require.Equal(t, "bulk.mail", handlerField, "the filter is kept across pages")
	require.True(t, strings.HasSuffix(strings.TrimSpace(third), "SMTP 451 for mail 1"), "the oldest last: %s", third)
	require.Contains(t, third, "SMTP 451 for mail 20\n")
	require.NotContains(t, third, "SMTP 451 for mail 21\n", "page 2 ended at mail 21")
	require.NotContains(t, third, "notifications.mail")

	// Readable by everyone: axe-core (vendored, testdata/axe-core) finds no
	// serious or critical violation on any page, logged in (every form
	// there), and at 400 px wide no page is wider than the screen.
	axe, err := os.ReadFile("testdata/axe-core/axe.min.js")
	require.NoError(t, err)
	poisonID := pipelinetest.PoisonIDs(t, h.app.Pool(), pgpoison.Filter{})[0]
	holds, err := pgheld.List(context.Background(), h.app.Pool())
	require.NoError(t, err)
	require.NotEmpty(t, holds)
	pages := []string{"/console/", "/console/retrying", "/console/failing", "/console/poison", "/console/poison?group=1",
		fmt.Sprintf("/console/poison/%d", poisonID), "/console/audit", "/console/login", "/console/handlers", "/console/search?q=account-7",
		"/console/held/" + holds[0].Consumer}
	awaitPromise := func(p *runtime.EvaluateParams) *runtime.EvaluateParams { return p.WithAwaitPromise(true) }
	for _, width := range []int64{1400, 400} {
		run("viewport", emulation.SetDeviceMetricsOverride(width, 900, 1, width < 600))
		for _, page := range pages {
			var violations, wide []string
			var scrollWidth int64
			run("axe "+page, chromedp.Navigate(srv.URL+page), chromedp.WaitReady("main"),
				chromedp.Evaluate(string(axe), nil),
				chromedp.Evaluate(`axe.run(document, {runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21aa"]}}).then(r =>
					r.violations.filter(v => v.impact === "serious" || v.impact === "critical").map(v => v.id + ": " + v.help + " (" + v.nodes.length + " nodes)"))`,
					&violations, awaitPromise),
				chromedp.Evaluate(`document.documentElement.scrollWidth`, &scrollWidth),
				chromedp.Evaluate(`[...document.querySelectorAll("main *")].filter(e => e.getBoundingClientRect().right > innerWidth && ![...e.children].some(c => c.getBoundingClientRect().right > innerWidth)).slice(0, 5).map(e => e.tagName + (e.id ? "#" + e.id : "") + " " + e.textContent.slice(0, 40))`, &wide))
			require.Empty(t, violations, "%s at %d px", page, width)
			require.LessOrEqual(t, scrollWidth, width, "%s is wider than a %d px screen: %q", page, width, wide)
		}
	}
	// A group action under a filter acts within it: the group's 150 share a
	// fingerprint, the filter shows 120 of them, the confirmation counts
	// 120 and the 30 outside the filter stay.
	var groupCount, total string
	run("viewport back", emulation.ClearDeviceMetricsOverride())
	run("discard group under a filter", chromedp.Navigate(srv.URL+"/console/poison?handler=bulk.mail"), chromedp.WaitVisible("#groups"),
		chromedp.Text(".pager", &total), chromedp.Click(`#groups button[value="discard"]`, chromedp.NodeVisible),
		chromedp.WaitVisible("#count"), chromedp.Text("#count", &groupCount), shot("console-group-confirm.png"))
	require.Contains(t, total, "of 120")
	require.Equal(t, "120", strings.TrimSpace(groupCount), "the confirmation counts what the filtered page shows")
	var in string
	run("the confirmation names the filter", chromedp.Text("#within", &in))
	require.Equal(t, "handler=bulk.mail", in)
	// The group grows between the confirmation and the click: only the
	// 120 shown go.
	poisonMany(t, h, "late-", "mail.send", "bulk.mail", "SMTP 451 for mail ", 10)
	// What the confirmation form posts, to post it again afterwards.
	var form string
	run("keep the confirmation form", chromedp.Evaluate(`new URLSearchParams(new FormData(document.querySelector("#confirm").form)).toString()`, &form))
	var flashURL string
	run("confirm discard", chromedp.Click("#confirm"), chromedp.WaitVisible("#flash"), chromedp.Text("#flash", &flash), chromedp.Location(&flashURL))
	require.Contains(t, flash, "discarded 120 message(s)")
	var mails, sms int
	counts := func() {
		t.Helper()
		mails = pipelinetest.CountPoisoned(t, h.app.Pool(), pgpoison.Filter{Handler: "bulk.mail"})
		sms = pipelinetest.CountPoisoned(t, h.app.Pool(), pgpoison.Filter{Handler: "bulk.sms"})
	}
	counts()
	require.Equal(t, 10, mails, "the 10 that arrived after the confirmation stay")
	require.Equal(t, 30, sms, "outside the filter, untouched")
	// Posting the same confirmation again (a browser re-sending the form)
	// does nothing.
	var again string
	run("re-send the confirmation", chromedp.Evaluate(`fetch("/console/actions", {method: "POST", headers: {"Content-Type": "application/x-www-form-urlencoded"}, body: `+strconv.Quote(form)+`}).then(r => r.status + " " + r.statusText).then(s => s)`,
		&again, func(p *runtime.EvaluateParams) *runtime.EvaluateParams { return p.WithAwaitPromise(true) }))
	require.Contains(t, again, "409", "the same confirmation again is refused")
	counts()
	require.Equal(t, 10, mails, "nothing was done a second time")
	// The discard is undone from its result, after its count and a
	// confirmation, as every action.
	var undoCount string
	run("undo", chromedp.Navigate(flashURL), chromedp.WaitVisible("#undo"), chromedp.Click("#undo"),
		chromedp.WaitVisible("#confirm-count"), chromedp.Text("#count", &undoCount), chromedp.Click("#confirm", chromedp.NodeVisible),
		// The page after the undo has no Undo of its own: wait for it, not
		// for the flash the page before it had.
		chromedp.WaitNotPresent("#undo"), chromedp.WaitVisible("#flash"), chromedp.Text("#flash", &flash))
	require.Equal(t, "120", strings.TrimSpace(undoCount))
	require.Contains(t, flash, "put back 120 message(s)")
	counts()
	require.Equal(t, 130, mails)

	// 200,000 in one confirmation: the click answers at once with a job
	// page that shows progress and then the result; nothing is re-sent.
	poisonMany(t, h, "flood-", "mail.send", "flood.mail", "SMTP 452 mailbox full for ", 200_000)
	var floodCount, jobState, jobResult string
	run("discard 200,000", chromedp.Navigate(srv.URL+"/console/poison?handler=flood.mail"), chromedp.WaitVisible("#groups"),
		chromedp.Click(`#groups button[value="discard"]`, chromedp.NodeVisible), chromedp.WaitVisible("#background"),
		chromedp.Text("#count", &floodCount))
	require.Equal(t, "200000", strings.TrimSpace(floodCount))
	clicked := time.Now()
	// The job's title stays while its progress block is swapped each second.
	run("confirm 200,000", chromedp.Click("#confirm"), chromedp.WaitVisible("#job-title"))
	require.Less(t, time.Since(clicked), 15*time.Second, "the click answers at once; the job runs on")
	run("job progress screenshot", shot("console-job.png"))
	deadline = time.Now().Add(4 * time.Minute)
	for jobState != "done" && jobState != "failed" && time.Now().Before(deadline) {
		time.Sleep(time.Second)
		// Read in one go in the page: the job's block is swapped every
		// second, and a node found before a swap is gone after it.
		run("job state", chromedp.Evaluate(`(document.querySelector("#job-state") || {}).textContent || ""`, &jobState))
	}
	require.Equal(t, "done", jobState)
	t.Logf("200,000 discarded in the background in %s", time.Since(clicked).Round(time.Second))
	run("job result", chromedp.Evaluate(`(document.querySelector("#job-result") || {}).textContent || ""`, &jobResult), shot("console-job-done.png"))
	require.Contains(t, jobResult, "discarded 200000 message(s)")
	require.Zero(t, pipelinetest.CountPoisoned(t, h.app.Pool(), pgpoison.Filter{Handler: "flood.mail"}))

	run("narrow screenshot", emulation.SetDeviceMetricsOverride(400, 900, 1, true), chromedp.Navigate(srv.URL+"/console/"), chromedp.WaitReady("main"), shot("console-overview-400px.png"))
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatal("the browser run timed out")
	}
}

// poisonMany poisons n messages of handler on topic, prefix1…prefixn, each
// with reason followed by its number.
func poisonMany(t *testing.T, h *harness, prefix, topic, handler, reason string, n int) {
	t.Helper()
	rows := make([]pipelinetest.PoisonRow, n)
	for i := range rows {
		g := strconv.Itoa(i + 1)
		rows[i] = pipelinetest.PoisonRow{MessageID: prefix + g, Topic: topic, Handler: handler, Reason: reason + g}
	}
	pipelinetest.InsertPoison(t, h.app.Pool(), rows...)
}
