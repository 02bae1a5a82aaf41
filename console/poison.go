package console

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgconfirm"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

func (c *Console) poisonPage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := filterFrom(q)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		c.render(w, r, "poison", &poisonPage{Error: err.Error(), Q: q})
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
		c.render(w, r, "poison", &poisonPage{Error: err.Error(), Q: q})
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
	c.render(w, r, "poison", &poisonPage{Q: q, Groups: groups, Records: page.Records, Total: total,
		Older:       pageLink(c.cfg.Prefix+"/poison", q, page.Older, "before", page.Records, true),
		Newer:       pageLink(c.cfg.Prefix+"/poison", q, page.Newer, "after", page.Records, false),
		FilterQuery: filterQuery(q), FilterFields: filterFields(q), Flash: c.flash(q), Undo: c.undoRun(q)})
}

type detail struct {
	R         pgpoison.Record
	Payload   string
	PayloadJS bool
	Truncated bool
	Headers   [][2]string
	History   []pipeline.FailedAttempt
	Requeued  string
	Current   asCurrent
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
	d := detail{R: rec, History: pipeline.ErrorHistory(rec.Headers), Requeued: rec.Headers["ferry_requeued_from_poison_id"],
		Current: c.upcast(rec.Topic, rec.Headers, rec.Payload)}
	d.Payload, d.PayloadJS, d.Truncated = shownPayload(c.masked(rec.Payload))
	d.Headers = sortedHeaders(rec.Headers)
	c.render(w, r, "detail", &detailPage{D: d})
}

// action is a requeue or discard: without confirm=1 it counts what would
// be touched and asks; with it, it acts, records the audit entry and goes
// back to the poison page with what was done.
func (c *Console) action(w http.ResponseWriter, r *http.Request) {
	form := r.PostForm
	for _, k := range append([]string{"action", "scope", "confirm", "nonce", "q"}, filterKeys...) {
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
	// The confirmation binds the exact set it showed: the preview keeps
	// the ids it counted (at most MaxBackgroundRows, the oldest) under a
	// single-use nonce (pgconfirm), and the action takes those ids and
	// nothing else: a message that joined the selection afterwards, or came
	// back under an older id (an Undo), is left alone, and one that left it
	// is reported as gone. The audit entry written with the action records
	// the nonce; a unique index refuses a second one. A link or a form that
	// says confirm=1 by itself confirms nothing. The selection is the
	// library's canonical text, as the command line writes it: what the
	// confirmation is signed for and the audit records.
	selection := sel.Scope()
	shown, ok, err := c.confirmed(r, "poison", act, selection)
	if err != nil {
		c.confirmationFailed(w, r, err)
		return
	}
	if !ok {
		ids, total, err := c.store.SelectIDs(r.Context(), sel, c.cfg.MaxBackgroundRows)
		if err != nil {
			c.internal(w, r, err)
			return
		}
		// The filter as it was resolved: "since=24h" is carried back as
		// the time it meant, so that the click names the same selection.
		fields := filterFields(sel.Filter.Values())
		for _, id := range sel.IDs {
			fields = append(fields, [2]string{"id", strconv.FormatInt(id, 10)})
		}
		named, token, err := c.preview(r, pgconfirm.Preview{Kind: "poison", Action: act, Selection: selection, IDs: ids, Total: total})
		if err != nil {
			c.internal(w, r, err)
			return
		}
		var in string
		if scope == "group" {
			in = within(sel.Filter)
		}
		c.render(w, r, "confirm", &confirmPage{Action: act, Scope: scope, Within: in, Count: len(ids), Total: total, Fields: append(fields, named...),
			Background: len(ids) > MaxActionRows, Confirm: token, TTL: c.ttl()})
		return
	}
	if len(shown.IDs) == 0 {
		// Nothing was shown, so nothing is taken.
		flash := act + ": 0 message(s); the confirmation showed none"
		c.redirectFlash(w, r, "/poison", flash, nil)
		return
	}
	sel = pgpoison.Selector{IDs: shown.IDs}
	nonce := r.PostForm.Get("nonce")
	count := len(shown.IDs)
	run := c.store.RequeueEach
	if act == "discard" {
		run = c.store.DiscardEach
	}
	runInfo := pgpoison.Run{Actor: c.actor(r), Scope: selection, Confirmation: nonce, ID: newNonce()[:16]}
	if count > MaxActionRows {
		c.startJob(w, r, act, runInfo, count, func(ctx context.Context, fn func(pgpoison.Action) error) (pgpoison.Summary, error) {
			return run(ctx, sel, runInfo, fn)
		})
		return
	}
	var skipped []string
	sum, err := run(r.Context(), sel, runInfo, func(a pgpoison.Action) error {
		if !a.Done && len(skipped) < 20 {
			skipped = append(skipped, fmt.Sprintf("#%d: %s", a.Record.ID, a.Why))
		}
		return nil
	})
	if errors.Is(err, pgaudit.ErrConfirmationUsed) {
		c.fail(w, r, http.StatusConflict, err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := actionResult(act, count, sum, ": "+strings.Join(skipped, "; "))
	var undo url.Values
	if act == "discard" && sum.Done > 0 {
		undo = url.Values{"undo": {sum.Run}, "undo_sig": {c.mac("undo\x00" + sum.Run)}}
	}
	c.redirectFlash(w, r, "/poison", flash, undo)
}

// within is the filter a group action is confined to, "" for none.
func within(f pgpoison.Filter) string {
	f.Fingerprint = ""
	if w := f.String(); w != "all" {
		return w
	}
	return ""
}

// undoRun is the run a signed link names for its Undo button: only the
// console's own redirect after a discard carries one.
func (c *Console) undoRun(q url.Values) string {
	run := q.Get("undo")
	if run == "" || c.cfg.Token == "" || subtle.ConstantTimeCompare([]byte(q.Get("undo_sig")), []byte(c.mac("undo\x00"+run))) != 1 {
		return ""
	}
	return run
}

// actionResult says what a confirmed requeue or discard of shown messages
// did, in the request or as a background job: skipped follows the count
// of the messages it skipped (their reasons, or where to find them).
func actionResult(act string, shown int, sum pgpoison.Summary, skipped string) string {
	verb := map[string]string{"requeue": "requeued", "discard": "discarded", "undo": "put back"}[act]
	text := fmt.Sprintf("%s %d message(s)", verb, sum.Done)
	if sum.Skipped > 0 {
		text += fmt.Sprintf("; skipped %d%s", sum.Skipped, skipped)
	}
	if gone := shown - sum.Done - sum.Skipped; gone > 0 {
		text += fmt.Sprintf("; %d of the %d confirmed were no longer in the store", gone, shown)
	}
	return text
}
