package console

import (
	"bytes"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/internal/attention"
	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// Bounds of what a page shows: hostile or huge content stays readable.
const (
	pageSize        = 50
	maxCell         = 120
	maxDetailBytes  = 64 << 10
	latencyWindow   = 15 * time.Minute
	recentAuditRows = 100
)

func (c *Console) funcs() template.FuncMap {
	return template.FuncMap{
		"cut":  func(s string) string { return clean(s, maxCell) },
		"full": func(s string) string { return clean(s, maxDetailBytes) },
		"ago": func(t time.Time) string {
			if t.IsZero() {
				return "—"
			}
			return display.Age(time.Since(t)) + " ago"
		},
		"secs": func(s float64) string {
			return (time.Duration(s * float64(time.Second))).Round(time.Millisecond).String()
		},
		"ts": func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
		"deref": func(p any) any {
			switch v := p.(type) {
			case *float64:
				return *v
			case *int:
				return *v
			}
			return p
		},
	}
}

// clean is display.Escape keeping line breaks: html/template escapes
// markup, this keeps invisible or reordering characters from hiding what a
// reason says, and bounds it.
func clean(s string, max int) string { return display.Escape(s, max, true) }

type overview struct {
	Report      pgstatus.Report
	P95         *float64
	PoisonByHdl []countRow
	Unrouted    *int
	UnroutedErr string
	Queues      []rabbit.QueueStat
	QueuesErr   string
	Failing     int
	// Attention is the list `ferry status` prints under "needs attention".
	Attention []string
	// Charts are the last hour, from the processes' samples; NoSamples
	// when no process has sampled in that hour.
	Charts    []chart
	NoSamples bool
}

type countRow struct {
	Name  string
	Count int
}

func (c *Console) overview(r *http.Request) (overview, error) {
	ctx := r.Context()
	var o overview
	rep, err := pgstatus.Collect(ctx, c.pool, c.cfg.OutboxTable, pgstatus.DefaultAttemptsThreshold)
	if err != nil {
		return o, err
	}
	o.Report = rep
	if o.P95, err = c.ops.DispatchP95(ctx, latencyWindow); err != nil {
		return o, err
	}
	if o.Failing, err = c.ops.FailingCount(ctx); err != nil {
		return o, err
	}
	byHandler, err := c.store.CountByHandler(ctx)
	if err != nil {
		return o, err
	}
	for _, h := range byHandler {
		o.PoisonByHdl = append(o.PoisonByHdl, countRow{Name: h.Name, Count: h.Count})
	}
	if c.cfg.Queues != nil {
		if o.Queues, err = c.cfg.Queues(ctx); err != nil {
			o.QueuesErr = "unknown (broker not reachable)"
		}
	}
	var brokerErr string
	if c.cfg.Unrouted != nil {
		n, err := c.cfg.Unrouted(ctx)
		switch {
		case rabbit.IsQueueMissing(err):
			// The broker answered: the queue is not declared yet.
			o.UnroutedErr = "none yet (no relay has declared the topology)"
		case err != nil:
			o.UnroutedErr = "unknown (broker not reachable)"
			brokerErr = pipeline.CleanText(err.Error(), 300)
		default:
			o.Unrouted = &n
		}
	}
	pts, err := pgstatus.History(ctx, c.pool, time.Hour, time.Minute)
	if err != nil {
		return o, err
	}
	o.Charts = overviewCharts(pts)
	o.NoSamples = true
	for _, p := range pts {
		if p.Samples > 0 {
			o.NoSamples = false
		}
	}
	o.Attention = attention.List(attention.State{Report: rep, BrokerError: brokerErr, Unrouted: o.Unrouted, Queues: o.Queues})
	return o, nil
}

func (c *Console) overviewPage(w http.ResponseWriter, r *http.Request) {
	o, err := c.overview(r)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "overview", map[string]any{"O": o})
}

func (c *Console) overviewPartial(w http.ResponseWriter, r *http.Request) {
	o, err := c.overview(r)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "overview-body", map[string]any{"O": o})
}

func (c *Console) internal(w http.ResponseWriter, r *http.Request, err error) {
	c.cfg.Logger.ErrorContext(r.Context(), "console: a page failed", "path", r.URL.Path, "error", err)
	c.fail(w, r, http.StatusInternalServerError, "the page could not be built (the process's log says why)")
}

// filterFrom reads the poison filter from a query or a form.
func filterFrom(v url.Values) (pgpoison.Filter, error) {
	f := pgpoison.Filter{Topic: v.Get("topic"), Handler: v.Get("handler"), AggregateID: v.Get("aggregate"),
		Text: v.Get("q"), Fingerprint: v.Get("fingerprint"), CorrelationID: v.Get("correlation"), MessageID: v.Get("message"), Limit: pageSize}
	var errs []error
	if s := v.Get("after"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			errs = append(errs, errors.New("after must be a poison id"))
		}
		f.AfterID = n
	}
	for name, dst := range map[string]*time.Time{"since": &f.Since, "until": &f.Until} {
		s := v.Get(name)
		if s == "" {
			continue
		}
		if d, err := time.ParseDuration(s); err == nil && d > 0 {
			*dst = time.Now().Add(-d)
			continue
		}
		t, err := time.Parse(time.RFC3339, s)
		if err != nil {
			if t2, err2 := time.Parse("2006-01-02T15:04", s); err2 == nil {
				t, err = t2, nil
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s must be a duration back from now (24h) or a time (2026-12-03T10:00)", name))
		}
		*dst = t
	}
	return f, errors.Join(errs...)
}

// filterKeys are the query keys of a filter: the only ones a page passes
// on into its forms and links. Anything else in a crafted link (an action,
// a scope, a confirmation) is dropped, so a click on one button cannot
// carry another's meaning.
var filterKeys = []string{"topic", "handler", "aggregate", "q", "fingerprint", "correlation", "message", "since", "until"}

// filterValues is the filter part of v, one value per key.
func filterValues(v url.Values) url.Values {
	out := url.Values{}
	for _, k := range filterKeys {
		if s := v.Get(k); s != "" {
			out.Set(k, s)
		}
	}
	return out
}

// filterFields are the filter's hidden inputs, in a fixed order.
func filterFields(v url.Values) [][2]string {
	var out [][2]string
	for _, k := range filterKeys {
		if s := v.Get(k); s != "" {
			out = append(out, [2]string{k, s})
		}
	}
	return out
}

// nextPage is the query of the page after the one that ended at lastID.
func nextPage(q url.Values, lastID int64) string {
	nq := filterValues(q)
	nq.Set("after", strconv.FormatInt(lastID, 10))
	return nq.Encode()
}

// pageBounds reads a newest-first page's bounds: before (older than an
// id) or after (newer than an id).
func pageBounds(q url.Values) (before, after int64, err error) {
	for name, dst := range map[string]*int64{"before": &before, "after": &after} {
		if v := q.Get(name); v != "" {
			n, perr := strconv.ParseInt(v, 10, 64)
			if perr != nil || n <= 0 {
				return 0, 0, fmt.Errorf("%s must be a poison id", name)
			}
			*dst = n
		}
	}
	if before > 0 && after > 0 {
		return 0, 0, errors.New("give before or after, not both")
	}
	return before, after, nil
}

// pageLink is the href of the older (from the page's last record) or
// newer (from its first) page, with the filter kept; "" when there is
// none. Built whole here: html/template would escape the "=" of a query
// written into an attribute after "?", and the link would lose its page
// and its filter.
func pageLink(path string, q url.Values, exists bool, key string, recs []pgpoison.Record, last bool) template.URL {
	if !exists || len(recs) == 0 {
		return ""
	}
	id := recs[0].ID
	if last {
		id = recs[len(recs)-1].ID
	}
	nq := filterValues(q)
	nq.Set(key, strconv.FormatInt(id, 10))
	return template.URL(path + "?" + nq.Encode())
}

func filterQuery(v url.Values) string { return filterValues(v).Encode() }

func (c *Console) poisonPage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := filterFrom(q)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		c.render(w, r, "poison", map[string]any{"Error": err.Error(), "Q": q})
		return
	}
	groupFilter := f
	groupFilter.AfterID, groupFilter.Limit = 0, 0
	groups, err := c.store.Groups(r.Context(), groupFilter, 50)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	before, after, err := pageBounds(q)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		c.render(w, r, "poison", map[string]any{"Error": err.Error(), "Q": q})
		return
	}
	page, err := c.store.PageOf(r.Context(), groupFilter, before, after, pageSize)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	total, err := c.store.Count(r.Context(), groupFilter)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "poison", map[string]any{"Q": q, "Groups": groups, "Records": page.Records, "Total": total,
		"Older":       pageLink(c.cfg.Prefix+"/poison", q, page.Older, "before", page.Records, true),
		"Newer":       pageLink(c.cfg.Prefix+"/poison", q, page.Newer, "after", page.Records, false),
		"FilterQuery": filterQuery(q), "FilterFields": filterFields(q), "Flash": c.flash(q)})
}

type detail struct {
	R         pgpoison.Record
	Payload   string
	PayloadJS bool
	Truncated bool
	Headers   [][2]string
	History   []pipeline.FailedAttempt
	Requeued  string
}

func (c *Console) detailPage(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		c.fail(w, r, http.StatusNotFound, "no such poisoned message")
		return
	}
	rec, err := c.store.Get(r.Context(), id)
	if errors.Is(err, pgpoison.ErrNotFound) {
		c.fail(w, r, http.StatusNotFound, "no such poisoned message")
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	d := detail{R: rec, History: pipeline.ErrorHistory(rec.Headers), Requeued: rec.Headers["ferry_requeued_from_poison_id"]}
	payload := rec.Payload
	if len(payload) > maxDetailBytes {
		payload, d.Truncated = payload[:maxDetailBytes], true
	}
	var pretty bytes.Buffer
	if !d.Truncated && json.Valid(payload) && json.Indent(&pretty, payload, "", "  ") == nil {
		d.Payload, d.PayloadJS = pretty.String(), true
	} else {
		d.Payload = string(payload)
	}
	for k, v := range rec.Headers {
		d.Headers = append(d.Headers, [2]string{k, v})
	}
	sort.Slice(d.Headers, func(a, b int) bool { return d.Headers[a][0] < d.Headers[b][0] })
	c.render(w, r, "detail", map[string]any{"D": d})
}

// failingPage shows the rows the relay keeps failing to publish, grouped
// by error fingerprint, filtered and paged by id like the poison store.
func (c *Console) failingPage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := filterFrom(q)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		c.render(w, r, "failing", map[string]any{"Error": err.Error(), "Q": q})
		return
	}
	groups, err := c.ops.FailingGroups(r.Context(), f, 100)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	list, err := c.ops.FailingRows(r.Context(), f, pageSize)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	var next template.URL
	if len(list) == pageSize {
		next = template.URL(c.cfg.Prefix + "/failing?" + nextPage(q, list[len(list)-1].ID))
	}
	c.render(w, r, "failing", map[string]any{"Groups": groups, "Rows": list, "Q": q, "Next": next, "Flash": c.flash(q)})
}

func (c *Console) auditPage(w http.ResponseWriter, r *http.Request) {
	entries, err := pgaudit.List(r.Context(), c.pool, recentAuditRows)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "audit", map[string]any{"Entries": entries})
}

// action is a requeue or discard: without confirm=1 it counts what would
// be touched and asks; with it, it acts, records the audit entry and goes
// back to the poison page with what was done.
func (c *Console) action(w http.ResponseWriter, r *http.Request) {
	form := r.PostForm
	for _, k := range append([]string{"action", "scope", "confirm"}, filterKeys...) {
		if len(form[k]) > 1 {
			c.fail(w, r, http.StatusBadRequest, "the form names "+k+" more than once")
			return
		}
	}
	act := form.Get("action")
	if act != "requeue" && act != "discard" {
		c.fail(w, r, http.StatusBadRequest, "the action must be requeue or discard")
		return
	}
	f, err := filterFrom(form)
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	f.AfterID, f.Limit = 0, 0
	sel := pgpoison.Selector{Filter: f}
	scope := form.Get("scope")
	switch scope {
	case "selected":
		for _, s := range form["id"] {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil || id <= 0 {
				c.fail(w, r, http.StatusBadRequest, "a selected id is not a poison id")
				return
			}
			sel.IDs = append(sel.IDs, id)
		}
		if len(sel.IDs) == 0 {
			c.fail(w, r, http.StatusBadRequest, "select at least one message")
			return
		}
		sel.Filter = pgpoison.Filter{}
	case "group":
		if f.Fingerprint == "" {
			c.fail(w, r, http.StatusBadRequest, "a group action needs its fingerprint")
			return
		}
	case "filter":
		if f == (pgpoison.Filter{}) {
			sel.All = true
		}
	default:
		c.fail(w, r, http.StatusBadRequest, "the scope must be selected, group or filter")
		return
	}
	countFilter := sel.Filter
	var n int
	if len(sel.IDs) > 0 {
		n, err = c.store.CountIDs(r.Context(), sel.IDs)
	} else {
		n, err = c.store.Count(r.Context(), countFilter)
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	// The confirmation is a token only the confirm step hands out, bound
	// to this action on this selection: a link or a form that says
	// confirm=1 by itself confirms nothing.
	confirmToken := c.mac("confirm\x00" + act + "\x00" + scopeText(scope, sel))
	if got := form.Get("confirm"); got == "" || subtle.ConstantTimeCompare([]byte(got), []byte(confirmToken)) != 1 {
		fields := filterFields(form)
		for _, id := range sel.IDs {
			fields = append(fields, [2]string{"id", strconv.FormatInt(id, 10)})
		}
		var in string
		if scope == "group" {
			in = within(sel.Filter)
		}
		c.render(w, r, "confirm", map[string]any{"Action": act, "Scope": scope, "Within": in, "Count": n, "Fields": fields, "Confirm": confirmToken})
		return
	}
	run := c.store.RequeueEach
	if act == "discard" {
		run = c.store.DiscardEach
	}
	var skipped []string
	sum, err := run(r.Context(), sel, pgpoison.Run{Actor: c.actor(r), Scope: scopeText(scope, sel)}, func(a pgpoison.Action) error {
		if !a.Done && len(skipped) < 20 {
			skipped = append(skipped, fmt.Sprintf("#%d: %s", a.Record.ID, a.Why))
		}
		return nil
	})
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := fmt.Sprintf("requeued %d message(s)", sum.Done)
	if act == "discard" {
		flash = fmt.Sprintf("discarded %d message(s)", sum.Done)
	}
	if sum.Skipped > 0 {
		flash += fmt.Sprintf("; skipped %d: %s", sum.Skipped, strings.Join(skipped, "; "))
	}
	http.Redirect(w, r, c.cfg.Prefix+"/poison?"+url.Values{"flash": {flash}, "sig": {c.mac("flash\x00" + flash)}}.Encode(), http.StatusSeeOther)
}

// flash is the result message the action redirected with, when the
// console itself wrote it (signed): a link cannot put words of its own in
// the green success banner.
func (c *Console) flash(q url.Values) string {
	text := q.Get("flash")
	if text == "" || c.cfg.Token == "" || subtle.ConstantTimeCompare([]byte(q.Get("sig")), []byte(c.mac("flash\x00"+text))) != 1 {
		return ""
	}
	return text
}

// within is the filter a group action is confined to, "" for none.
func within(f pgpoison.Filter) string {
	f.Fingerprint = ""
	if w := f.String(); w != "all" {
		return w
	}
	return ""
}

func scopeText(scope string, sel pgpoison.Selector) string {
	switch scope {
	case "selected":
		ids := make([]string, len(sel.IDs))
		for i, id := range sel.IDs {
			ids[i] = strconv.FormatInt(id, 10)
		}
		return "ids " + strings.Join(ids, ",")
	case "group":
		if w := within(sel.Filter); w != "" {
			return "group " + sel.Filter.Fingerprint + " within " + w
		}
		return "group " + sel.Filter.Fingerprint
	}
	return "filter " + sel.Filter.String()
}

// retryingPage shows the durable retries waiting for their handler, by
// handler and error fingerprint, with "retry now" and "discard".
func (c *Console) retryingPage(w http.ResponseWriter, r *http.Request) {
	groups, total, err := pgstatus.Retrying(r.Context(), c.pool, c.cfg.OutboxTable, 100)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "retrying", map[string]any{"Groups": groups, "Total": total, "Flash": c.flash(r.URL.Query())})
}

// outboxAction is "retry now" (due at once) or "discard" (deleted) on
// pending outbox rows: durable retries (kind retrying: a handler and an
// error fingerprint) or rows the relay keeps failing to publish (kind
// failing: a fingerprint). Like the poison store's actions it shows the
// count first, takes a confirmation only from that step, acts in one
// transaction and records the audit entry.
func (c *Console) outboxAction(w http.ResponseWriter, r *http.Request) {
	form := r.PostForm
	for _, k := range []string{"kind", "action", "scope", "confirm", "handler", "fingerprint"} {
		if len(form[k]) > 1 {
			c.fail(w, r, http.StatusBadRequest, "the form names "+k+" more than once")
			return
		}
	}
	kind, act, scopeName := form.Get("kind"), form.Get("action"), form.Get("scope")
	if (kind != "retrying" && kind != "failing") || (act != "retry-now" && act != "discard") || (scopeName != "group" && scopeName != "selected") {
		c.fail(w, r, http.StatusBadRequest, "kind must be retrying or failing, action retry-now or discard, scope group or selected")
		return
	}
	sel := pgoutbox.Stuck{Kind: pgoutbox.PendingKind(kind), Fingerprint: form.Get("fingerprint")}
	if kind == "retrying" {
		sel.Handler = form.Get("handler")
	}
	if scopeName == "selected" {
		sel.Fingerprint, sel.Handler = "", ""
		for _, v := range form["id"] {
			id, err := strconv.ParseInt(v, 10, 64)
			if err != nil || id <= 0 {
				c.fail(w, r, http.StatusBadRequest, "a selected id is not an outbox row id")
				return
			}
			sel.IDs = append(sel.IDs, id)
		}
		if len(sel.IDs) == 0 {
			c.fail(w, r, http.StatusBadRequest, "select at least one row")
			return
		}
	}
	if err := sel.Validate(); err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	n, err := c.ops.Count(r.Context(), sel)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	confirmToken := c.mac("outbox\x00" + act + "\x00" + sel.String())
	if got := form.Get("confirm"); got == "" || subtle.ConstantTimeCompare([]byte(got), []byte(confirmToken)) != 1 {
		fields := [][2]string{{"fingerprint", sel.Fingerprint}}
		if kind == "retrying" {
			fields = append(fields, [2]string{"handler", sel.Handler})
		}
		if scopeName == "selected" {
			fields = fields[:0]
			for _, id := range sel.IDs {
				fields = append(fields, [2]string{"id", strconv.FormatInt(id, 10)})
			}
		}
		c.render(w, r, "outbox-confirm", map[string]any{"Kind": kind, "Action": act, "Scope": scopeName, "Count": n, "Fields": fields, "Confirm": confirmToken})
		return
	}
	do := c.ops.RetryNow
	if act == "discard" {
		do = c.ops.Discard
	}
	done, err := do(r.Context(), sel, c.actor(r))
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := fmt.Sprintf("%s: %d row(s)", act, len(done.IDs))
	http.Redirect(w, r, c.cfg.Prefix+"/"+kind+"?"+url.Values{"flash": {flash}, "sig": {c.mac("flash\x00" + flash)}}.Encode(), http.StatusSeeOther)
}

// outboxRow is one outbox row as its detail page shows it.
type outboxRow struct {
	ID                     int64
	MessageID, Topic       string
	AggregateID, LastError string
	Payload                string
	Headers                [][2]string
	Attempts               int
	CreatedAt, AvailableAt time.Time
	Dispatched             bool
}

// outboxRowPage shows one outbox row whole (a failing row's last error,
// payload, headers) with "retry now" and "discard" while it is pending.
func (c *Console) outboxRowPage(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		c.fail(w, r, http.StatusNotFound, "no such outbox row")
		return
	}
	got, err := c.ops.Row(r.Context(), id)
	if errors.Is(err, pgoutbox.ErrNoRow) {
		c.fail(w, r, http.StatusNotFound, "no such outbox row")
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	row := outboxRow{ID: got.ID, MessageID: got.MessageID, Topic: got.Topic, AggregateID: got.AggregateID, LastError: got.LastError,
		Attempts: got.Attempts, CreatedAt: got.CreatedAt, AvailableAt: got.AvailableAt, Dispatched: got.Dispatched}
	payload, headers := got.Payload, got.Headers
	if len(payload) > maxDetailBytes {
		payload = payload[:maxDetailBytes]
	}
	var pretty bytes.Buffer
	if json.Valid(payload) && json.Indent(&pretty, payload, "", "  ") == nil {
		row.Payload = pretty.String()
	} else {
		row.Payload = string(payload)
	}
	for k, v := range headers {
		row.Headers = append(row.Headers, [2]string{k, v})
	}
	sort.Slice(row.Headers, func(a, b int) bool { return row.Headers[a][0] < row.Headers[b][0] })
	c.render(w, r, "outbox-row", map[string]any{"Row": row, "Flash": c.flash(r.URL.Query())})
}
