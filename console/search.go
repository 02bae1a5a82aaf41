package console

import (
	"fmt"
	"net/http"

	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// searchPage is "where is this message?": a message id, an aggregate id
// or a correlation id looked up in every store (pgstatus.Find, as `ferry
// find` does), each message with where it is now and its trail.
func (c *Console) searchPage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query().Get("q")
	p := &searchPage{Q: q}
	if q != "" {
		// A search scans what no index serves (FindTimeout bounds each
		// store), on the pool the consumers share: a few at once, so that
		// operators searching in an incident cannot take the connections
		// the pipeline needs.
		select {
		case c.searches <- struct{}{}:
			defer func() { <-c.searches }()
		default:
			w.Header().Set("Retry-After", "2")
			c.fail(w, r, http.StatusTooManyRequests, fmt.Sprintf("%d searches are running already (console.Config.MaxSearches): try again in a moment.", cap(c.searches)))
			return
		}
		found, err := pgstatus.Find(r.Context(), c.pool, c.cfg.OutboxTable, c.cfg.Routes, q, 50)
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			p.Error = err.Error()
		} else {
			p.Found = &found
		}
	}
	c.render(w, r, "search", p)
}
