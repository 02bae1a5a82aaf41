package console

import (
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"strconv"
	"time"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgconfirm"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// failingPage shows the rows the relay keeps failing to publish, grouped
// by error fingerprint, filtered and paged by id like the poison store.
func (c *Console) failingPage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := filterFrom(q)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		c.render(w, r, "failing", &failingPage{Error: err.Error(), Q: q})
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
	c.render(w, r, "failing", &failingPage{Groups: groups, Rows: list, Q: q, Next: next, Flash: c.flash(q)})
}

// outboxAction is "retry now" (due at once) or "discard" (deleted) on
// pending outbox rows: durable retries (kind retrying: a handler and an
// error fingerprint) or rows the relay keeps failing to publish (kind
// failing: a fingerprint). Like the poison store's actions it shows the
// count first, takes a confirmation only from that step, acts in one
// transaction and records the audit entry.
func (c *Console) outboxAction(w http.ResponseWriter, r *http.Request) {
	form := r.PostForm
	for _, k := range []string{"kind", "action", "scope", "confirm", "handler", "fingerprint", "nonce"} {
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
	// As the poison store's: the preview keeps the ids it counted (at
	// most MaxActionRows, the oldest; pgconfirm) and the action takes those,
	// still of this kind, and nothing else, once.
	selection := kind + " " + sel.String()
	shown, ok, err := c.confirmed(r, "outbox", act, selection)
	if err != nil {
		c.confirmationFailed(w, r, err)
		return
	}
	if !ok {
		ids, total, err := c.ops.SelectIDs(r.Context(), sel, MaxActionRows)
		if err != nil {
			c.internal(w, r, err)
			return
		}
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
		named, token, err := c.preview(r, pgconfirm.Preview{Kind: "outbox", Action: act, Selection: selection, IDs: ids, Total: total})
		if err != nil {
			c.internal(w, r, err)
			return
		}
		c.render(w, r, "outbox-confirm", &outboxConfirmPage{Kind: kind, Action: act, Scope: scopeName, Count: len(ids), Total: total,
			Fields: append(fields, named...), Confirm: token, TTL: c.ttl()})
		return
	}
	if len(shown.IDs) == 0 {
		// Nothing was shown, so nothing is taken.
		flash := act + ": 0 row(s); the confirmation showed none"
		c.redirectFlash(w, r, "/"+kind, flash, nil)
		return
	}
	nonce, count := r.PostForm.Get("nonce"), len(shown.IDs)
	sel = pgoutbox.Stuck{Kind: sel.Kind, IDs: shown.IDs}
	do := c.ops.RetryNow
	if act == "discard" {
		do = c.ops.Discard
	}
	done, err := do(r.Context(), sel, pgoutbox.By{Actor: c.actor(r), Confirmation: nonce})
	if errors.Is(err, pgaudit.ErrConfirmationUsed) {
		c.fail(w, r, http.StatusConflict, err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := fmt.Sprintf("%s: %d row(s)", act, len(done.IDs))
	if gone := count - len(done.IDs); gone > 0 {
		flash += fmt.Sprintf("; %d of the %d confirmed were no longer there", gone, count)
	}
	c.redirectFlash(w, r, "/"+kind, flash, nil)
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
	Current                asCurrent
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
	// Only what the failing and retrying pages list: a row sent, or one
	// waiting its first try, is no operator's business here, and its
	// payload is a customer's.
	failing := got.Attempts > 0 && got.LastError != ""
	if got.Dispatched || !(failing || got.Topic == pipeline.RetryTopic) {
		c.fail(w, r, http.StatusNotFound, "this outbox row is not failing or retrying: the console shows only those (ferry find says where any message is)")
		return
	}
	row := outboxRow{ID: got.ID, MessageID: got.MessageID, Topic: got.Topic, AggregateID: got.AggregateID, LastError: got.LastError,
		Attempts: got.Attempts, CreatedAt: got.CreatedAt, AvailableAt: got.AvailableAt, Dispatched: got.Dispatched}
	row.Current = c.upcast(got.Topic, got.Headers, got.Payload)
	row.Payload, _, _ = shownPayload(c.masked(got.Payload))
	row.Headers = sortedHeaders(got.Headers)
	c.render(w, r, "outbox-row", &outboxRowPage{Row: row, Flash: c.flash(r.URL.Query())})
}
