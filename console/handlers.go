package console

import (
	"errors"
	"fmt"
	"net/http"
	"slices"

	"github.com/ferry-dev/ferry/pipeline/pgpause"
)

// handlerRow is one route on the handlers page.
type handlerRow struct {
	Name  string
	Pause *pgpause.Pause
	// Known is false for a paused name the app has no route for.
	Known bool
}

// handlersPage lists the routes, paused or not, with Pause and Resume.
func (c *Console) handlersPage(w http.ResponseWriter, r *http.Request) {
	paused, err := pgpause.List(r.Context(), c.pool)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	byName := map[string]*pgpause.Pause{}
	for i := range paused {
		byName[paused[i].Handler] = &paused[i]
	}
	var rows []handlerRow
	for _, name := range c.cfg.Routes {
		rows = append(rows, handlerRow{Name: name, Pause: byName[name], Known: true})
	}
	for i := range paused {
		if !slices.Contains(c.cfg.Routes, paused[i].Handler) {
			rows = append(rows, handlerRow{Name: paused[i].Handler, Pause: &paused[i]})
		}
	}
	c.render(w, r, "handlers", &handlersPage{Rows: rows, Flash: c.flash(r.URL.Query())})
}

// handlerAction pauses or resumes a route (pgpause.Set and Clear, as
// `ferry pause` and `ferry resume` do).
func (c *Console) handlerAction(w http.ResponseWriter, r *http.Request) {
	name, act := r.PostForm.Get("handler"), r.PostForm.Get("action")
	var err error
	var flash string
	if act == "pause" && len(c.cfg.Routes) > 0 && !slices.Contains(c.cfg.Routes, name) {
		c.fail(w, r, http.StatusBadRequest, fmt.Sprintf("%q is not one of this app's routes", name))
		return
	}
	reason := r.PostForm.Get("reason")
	if (act == "pause" || act == "resume") && !c.asked(r, act, name, reason) {
		msg := fmt.Sprintf("This will resume %s: its consumers start taking messages again, at once everywhere.", name)
		if act == "pause" {
			msg = fmt.Sprintf("This will pause %s: every partition and worker of the route starts no message until it is resumed; its messages wait at the broker, in order.", name)
		}
		c.ask(w, r, askPage{Title: "Confirm " + act, Message: msg, Button: "Yes, " + act + " " + name, Cancel: "/handlers", Path: "/handler-actions",
			Fields: [][2]string{{"handler", name}, {"action", act}, {"reason", reason}}}, act, name, reason)
		return
	}
	switch act {
	case "pause":
		err = pgpause.Set(r.Context(), c.pool, name, c.actor(r), reason)
		flash = fmt.Sprintf("paused %s: its consumers start no message until it is resumed (within a few seconds everywhere)", name)
	case "resume":
		err = pgpause.Clear(r.Context(), c.pool, name, c.actor(r))
		flash = fmt.Sprintf("resumed %s", name)
	default:
		c.fail(w, r, http.StatusBadRequest, "the action must be pause or resume")
		return
	}
	if errors.Is(err, pgpause.ErrPaused) || errors.Is(err, pgpause.ErrNotPaused) {
		c.fail(w, r, http.StatusConflict, name+": "+err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.redirectFlash(w, r, "/handlers", flash, nil)
}
