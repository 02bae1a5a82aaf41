package console

import (
	"net/http"

	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// retryingPage shows the durable retries waiting for their handler, by
// handler and error fingerprint, with "retry now" and "discard".
func (c *Console) retryingPage(w http.ResponseWriter, r *http.Request) {
	groups, total, err := pgstatus.Retrying(r.Context(), c.pool, c.cfg.OutboxTable, 100)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "retrying", &retryingPage{Groups: groups, Total: total, Flash: c.flash(r.URL.Query())})
}
