package console

import (
	"net/http"
)

// retryingPage shows the durable retries waiting for their handler, by
// handler and error fingerprint, with "retry now" and "discard".
func (c *Console) retryingPage(w http.ResponseWriter, r *http.Request) {
	groups, total, err := c.cfg.OutboxTable.RetryGroups(r.Context(), c.pool, 100)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "retrying", &retryingPage{Groups: groups, Total: total, Flash: c.flash(r.URL.Query())})
}
