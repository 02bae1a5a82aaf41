package console

import (
	"net/http"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
)

func (c *Console) auditPage(w http.ResponseWriter, r *http.Request) {
	entries, err := pgaudit.List(r.Context(), c.pool, recentAuditRows)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.render(w, r, "audit", &auditPage{Entries: entries})
}
