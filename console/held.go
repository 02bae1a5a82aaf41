package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// heldPage is a held ordered partition's head: what it is, why it fails,
// how many messages wait behind it at the broker, and "retry now".
func (c *Console) heldPage(w http.ResponseWriter, r *http.Request) {
	consumer := r.PathValue("consumer")
	h, err := pgstatus.HeldHead(r.Context(), c.pool, consumer)
	if errors.Is(err, pgstatus.ErrNotHeld) {
		c.fail(w, r, http.StatusNotFound, "this partition is not held (any more): its head was handled or poisoned. The poison store and the audit log say which.")
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	p := &heldHeadPage{H: h, Route: pipeline.RouteName(h.Consumer), Flash: c.flash(r.URL.Query()), History: pipeline.ErrorHistory(h.Headers),
		Current: c.upcast(h.Headers[pipeline.MetaTopic], h.Headers, h.Payload)}
	p.Payload, _, p.Truncated = shownPayload(h.Payload)
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

// heldAction is "retry now" for a held head (pgstatus.RetryHeldNow).
func (c *Console) heldAction(w http.ResponseWriter, r *http.Request) {
	consumer, messageID := r.PostForm.Get("consumer"), r.PostForm.Get("message_id")
	if consumer == "" || messageID == "" {
		c.fail(w, r, http.StatusBadRequest, "name the partition and its head message")
		return
	}
	err := pgstatus.RetryHeldNow(r.Context(), c.pool, consumer, messageID, c.actor(r))
	if errors.Is(err, pgstatus.ErrNotHeld) {
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
