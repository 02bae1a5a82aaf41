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
	// A discard's run can be undone: its Undo goes on the run's newest
	// entry (a run of many pages has one entry per page).
	undo := make([]string, len(entries))
	seen := map[string]bool{}
	for i, e := range entries {
		if run, ok := e.Detail["run"].(string); ok && e.Action == "poison.discard" && run != "" && !seen[run] && e.Count > 0 {
			undo[i], seen[run] = run, true
		}
	}
	c.render(w, r, "audit", &auditPage{Entries: entries, Undo: undo})
}
