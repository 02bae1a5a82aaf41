package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
)

// heldPage is a held ordered partition's head: what it is, why it fails,
// how many messages wait behind it at the broker, and "retry now".
func (c *Console) heldPage(w http.ResponseWriter, r *http.Request) {
	consumer := r.PathValue("consumer")
	h, err := pgheld.Head(r.Context(), c.pool, consumer)
	if errors.Is(err, pgheld.ErrNotHeld) {
		c.fail(w, r, http.StatusNotFound, "this partition is not held (any more): its head was handled or poisoned. The poison store and the audit log say which.")
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	p := &heldHeadPage{H: h, Route: pipeline.RouteName(h.Consumer), Flash: c.flash(r.URL.Query()), History: pipeline.ErrorHistory(h.Headers),
		Current: c.upcast(h.Headers[pipeline.MetaTopic], h.Headers, h.Payload)}
	p.Payload, _, p.Truncated = shownPayload(c.masked(h.Payload))
	p.Headers = sortedHeaders(h.Headers)
	// Behind the head: the partition's queue's ready messages (the head
	// itself is unacked at its consumer).
	p.Behind = "the broker is not read by this console"
	if c.cfg.Queues != nil {
		stats, err := c.cfg.Queues(r.Context())
		switch {
		case err != nil:
			p.Behind = "the broker could not be read: " + pipeline.ErrorText(err, 200)
		default:
			p.Behind = "its queue was not found at the broker"
			for _, st := range stats {
				if st.Handler == h.Consumer {
					p.Waiting, p.Behind, p.Queue = &st.Ready, "", st.Queue
					break
				}
			}
		}
	}
	c.render(w, r, "held", p)
}

// heldAction is "retry now" for a held head (pgheld.RetryNow), or for
// every held partition of a route at once (pgheld.RetryRoute: one outage
// holds a partition per aggregate hash, eight clicks for one outage),
// asked first as every action is.
func (c *Console) heldAction(w http.ResponseWriter, r *http.Request) {
	if r.PostForm.Get("route") != "" {
		c.heldRouteAction(w, r)
		return
	}
	consumer, messageID := r.PostForm.Get("consumer"), r.PostForm.Get("message_id")
	if consumer == "" || messageID == "" {
		c.fail(w, r, http.StatusBadRequest, "name the partition and its head message, or the route")
		return
	}
	if !c.asked(r, "retry-now", consumer, messageID) {
		c.ask(w, r, askPage{Title: "Confirm retry now", Button: "Yes, retry " + consumer + " now", Cancel: "/held/" + url.PathEscape(consumer), Path: "/held-actions",
			Message: fmt.Sprintf("This will make %s try its head %s again within a second instead of waiting out its backoff; the try counts as an attempt.", consumer, messageID),
			Count:   1, Fields: [][2]string{{"consumer", consumer}, {"message_id", messageID}}}, "retry-now", consumer, messageID)
		return
	}
	err := pgheld.RetryNow(r.Context(), c.pool, consumer, messageID, c.actor(r))
	if errors.Is(err, pgheld.ErrNotHeld) {
		c.fail(w, r, http.StatusConflict, err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := fmt.Sprintf("asked %s to try %s again now (its consumer looks every second)", consumer, messageID)
	c.redirectFlash(w, r, "/held/"+url.PathEscape(consumer), flash, nil)
}

// heldRouteAction asks every held partition of route to retry its head
// now: the preview lists the heads held then, and the confirmation acts on
// those heads only (a partition that moved on to another head is left
// alone).
func (c *Console) heldRouteAction(w http.ResponseWriter, r *http.Request) {
	route := r.PostForm.Get("route")
	consumers, messages := r.PostForm["hc"], r.PostForm["hm"]
	words := []string{"retry-route", route}
	for i := range consumers {
		if i < len(messages) {
			words = append(words, consumers[i], messages[i])
		}
	}
	if len(consumers) == 0 || len(consumers) != len(messages) || !c.asked(r, words...) {
		all, err := pgheld.List(r.Context(), c.pool)
		if err != nil {
			c.internal(w, r, err)
			return
		}
		fields := [][2]string{{"route", route}}
		words = []string{"retry-route", route}
		n := 0
		for _, h := range all {
			if h.Route() == route {
				fields = append(fields, [2]string{"hc", h.Consumer}, [2]string{"hm", h.MessageID})
				words = append(words, h.Consumer, h.MessageID)
				n++
			}
		}
		if n == 0 {
			c.fail(w, r, http.StatusConflict, "no partition of "+route+" is held (any more)")
			return
		}
		c.ask(w, r, askPage{Title: "Confirm retry now", Button: fmt.Sprintf("Yes, retry %d partition(s) now", n), Cancel: "/", Path: "/held-actions", Count: n,
			Message: fmt.Sprintf("This will make every held partition of %s try its head again within a second instead of waiting out its backoff; each try counts as an attempt.", route),
			Fields:  fields}, words...)
		return
	}
	heads := map[string]string{}
	for i := range consumers {
		heads[consumers[i]] = messages[i]
	}
	asked, err := pgheld.RetryRoute(r.Context(), c.pool, route, c.actor(r), heads)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := fmt.Sprintf("asked %d held partition(s) of %s to try their heads again now", len(asked), route)
	if gone := len(heads) - len(asked); gone > 0 {
		flash += fmt.Sprintf("; %d of those shown were no longer held behind the same head", gone)
	}
	c.redirectFlash(w, r, "/", flash, nil)
}
