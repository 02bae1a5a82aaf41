package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/tenancy"
)

// tenantsFresh is how old the overview's read of the tenants may be: a
// read connects to every tenant's database (a server down makes it last
// the connect timeout), so the overview, refreshed every few seconds by
// every open console, shows the last read and starts the next in the
// background, while the tenants page reads them afresh.
const tenantsFresh = 30 * time.Second

// tenantsRead bounds one read of every tenant's status.
const tenantsRead = time.Minute

// tenantsCache is the last read of the tenants' statuses.
type tenantsCache struct {
	mu      sync.Mutex
	at      time.Time
	rows    []tenancy.Status
	err     error
	reading bool
}

// readTenants reads every tenant's status and keeps it for the overview.
func (c *Console) readTenants(ctx context.Context) ([]tenancy.Status, error) {
	rows, err := c.cfg.Tenants(ctx)
	c.tenants.mu.Lock()
	defer c.tenants.mu.Unlock()
	c.tenants.at, c.tenants.rows, c.tenants.err = time.Now(), rows, err
	return rows, err
}

// cachedTenants is the last read (zero at: none yet), and starts the next
// one in the background when it is older than tenantsFresh.
func (c *Console) cachedTenants() (rows []tenancy.Status, at time.Time, err error) {
	c.tenants.mu.Lock()
	defer c.tenants.mu.Unlock()
	if !c.tenants.reading && time.Since(c.tenants.at) > tenantsFresh {
		c.tenants.reading = true
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), tenantsRead)
			defer cancel()
			if _, err := c.readTenants(ctx); err != nil {
				c.cfg.Logger.Warn("console: reading the tenants' statuses failed", "error", err)
			}
			c.tenants.mu.Lock()
			c.tenants.reading = false
			c.tenants.mu.Unlock()
		}()
	}
	return c.tenants.rows, c.tenants.at, c.tenants.err
}

// tenantsPage lists every tenant of the fleet with its state and what
// needs a human, with Pause and Resume (pgtenants, as `ferry tenants
// pause` and `resume` do).
func (c *Console) tenantsPage(w http.ResponseWriter, r *http.Request) {
	if c.cfg.Tenants == nil {
		c.fail(w, r, http.StatusNotFound, "this console serves no tenant fleet (FERRY_TENANTS)")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), tenantsRead)
	defer cancel()
	rows, err := c.readTenants(ctx)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	p := &tenantsPage{Rows: rows, Flash: c.flash(r.URL.Query())}
	for _, t := range rows {
		if len(t.Attention) > 0 {
			p.NeedAHuman++
		}
	}
	c.render(w, r, "tenants", p)
}

// tenantAction pauses or resumes a tenant's relay, after a confirmation.
func (c *Console) tenantAction(w http.ResponseWriter, r *http.Request) {
	if c.cfg.Tenants == nil {
		c.fail(w, r, http.StatusNotFound, "this console serves no tenant fleet (FERRY_TENANTS)")
		return
	}
	id, act, reason := r.PostForm.Get("tenant"), r.PostForm.Get("action"), r.PostForm.Get("reason")
	if act != "pause" && act != "resume" {
		c.fail(w, r, http.StatusBadRequest, "the action must be pause or resume")
		return
	}
	if err := pgtenants.ValidateID(id); err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if !c.asked(r, "tenant", act, id, reason) {
		msg := fmt.Sprintf("This will resume tenant %s: the fleet relays its outbox again within a few seconds.", id)
		if act == "pause" {
			msg = fmt.Sprintf("This will pause tenant %s: the fleet stops relaying its outbox within a few seconds; its events wait there, in order, until it is resumed. Its messages already at the broker are still handled.", id)
		}
		c.ask(w, r, askPage{Title: "Confirm " + act, Message: msg, Button: "Yes, " + act + " " + id, Cancel: "/tenants", Path: "/tenant-actions",
			Fields: [][2]string{{"tenant", id}, {"action", act}, {"reason", reason}}}, "tenant", act, id, reason)
		return
	}
	var err error
	flash := "resumed tenant " + id
	if act == "pause" {
		err = pgtenants.Pause(r.Context(), c.pool, id, c.actor(r), reason)
		flash = "paused tenant " + id + ": the fleet stops relaying its outbox within a few seconds"
	} else {
		err = pgtenants.Resume(r.Context(), c.pool, id, c.actor(r))
	}
	if errors.Is(err, pgtenants.ErrNotFound) {
		c.fail(w, r, http.StatusNotFound, "tenant "+id+": "+err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	c.redirectFlash(w, r, "/tenants", flash, nil)
}
