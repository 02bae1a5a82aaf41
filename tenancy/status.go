package tenancy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgparked"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
)

// Status is one tenant as an operator sees it (ferry tenants status, ferry
// status, the console's tenants page).
type Status struct {
	pgtenants.Tenant
	// ServedBy is the fleet member that relays its outbox ("" when no
	// member is alive, or the tenant is paused).
	ServedBy string `json:"served_by"`
	Pending  int    `json:"pending"`
	Due      int    `json:"due"`
	// OldestDueAgeS is how long its oldest due event has waited.
	OldestDueAgeS float64 `json:"oldest_due_age_seconds"`
	// Failing counts the rows the relay keeps failing to publish.
	Failing int `json:"failing"`
	// Poisoned counts its messages in the poison store (the control
	// database's, filtered by tenant_id).
	Poisoned int `json:"poisoned"`
	// Parked counts its events parked out of ordered partitions while
	// its database was out of reach (Parking), and ParkedAgeS how long
	// the oldest has waited.
	Parked     int     `json:"parked"`
	ParkedAgeS float64 `json:"parked_age_seconds"`
	// Error says why its database could not be read.
	Error string `json:"error,omitempty"`
	// Attention says what needs a human; empty when nothing does.
	Attention []string `json:"attention"`
}

// StaleDue is how long a tenant's oldest due event may wait before its
// status calls for a human.
const StaleDue = time.Minute

// StatusConfig says where the statuses are read.
type StatusConfig struct {
	// ControlURL is the control database's URL: a tenant registered
	// without a URL lives there.
	ControlURL string
	// Outbox is the outbox table of every tenant.
	Outbox pgoutbox.Table
	// Poison is the control database's poison store.
	Poison *pgpoison.Store
	// Command is the binary's name in hints. Default "ferry".
	Command string
	// Timeout bounds the reads of one tenant's database. Default 10 s.
	Timeout time.Duration
}

// statusReads is how many tenants' databases are read at once: each is a
// connection of its own for the length of its reads.
const statusReads = 8

// Statuses reads the status of each of ts, in their order, and the
// fleet's live members. A tenant whose database cannot be read has its
// Error and an Attention line; only a control database that cannot be
// read fails the whole.
func Statuses(ctx context.Context, control *pgxpool.Pool, cfg StatusConfig, ts []pgtenants.Tenant) ([]Status, []string, error) {
	if control == nil || cfg.Poison == nil {
		return nil, nil, errors.New("tenancy: Statuses needs the control database and its poison store")
	}
	members, err := Members(ctx, control)
	if err != nil {
		return nil, nil, err
	}
	groups, err := pgparked.Store{Pool: control}.Groups(ctx, false)
	if err != nil {
		return nil, nil, err
	}
	out := make([]Status, len(ts))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(statusReads)
	for i, t := range ts {
		g.Go(func() error {
			out[i] = status(gctx, cfg, members, t)
			parked(&out[i], groups, cmp.Or(cfg.Command, "ferry"))
			return nil
		})
	}
	_ = g.Wait()
	return out, members, nil
}

func status(ctx context.Context, cfg StatusConfig, members []string, t pgtenants.Tenant) Status {
	cmd := cmp.Or(cfg.Command, "ferry")
	s := Status{Tenant: t, Attention: []string{}}
	if !t.Paused {
		s.ServedBy = Owner(members, t.ID)
		if s.ServedBy == "" {
			s.Attention = append(s.Attention, "no fleet member alive (FERRY_TENANTS=true on a relay)")
		}
	}
	if n, err := cfg.Poison.Count(ctx, pgpoison.Filter{Tenant: t.ID}); err == nil {
		s.Poisoned = n
		if n > 0 {
			s.Attention = append(s.Attention, fmt.Sprintf("%d poisoned (%s poison list --filter tenant=%s)", n, cmd, t.ID))
		}
	} else {
		s.Error = err.Error()
	}
	rctx, cancel := context.WithTimeout(ctx, cmp.Or(cfg.Timeout, 10*time.Second))
	defer cancel()
	pool, err := Connect(rctx, cfg.ControlURL, t, pgdb.Config{ApplicationName: cmd + "-tenants-status", MaxConns: 1})
	if err != nil {
		s.Error = err.Error()
		s.Attention = append(s.Attention, "its database is out of reach")
		return s
	}
	defer pool.Close()
	backlog, err := cfg.Outbox.Backlog(rctx, pool)
	if err == nil {
		for _, b := range backlog {
			s.Pending += b.Pending
			s.Due += b.Due
			s.OldestDueAgeS = max(s.OldestDueAgeS, b.OldestDueAgeS)
		}
		s.Failing, err = cfg.Outbox.CountFailing(rctx, pool)
	}
	if err != nil {
		s.Error = err.Error()
		s.Attention = append(s.Attention, "its outbox could not be read")
		return s
	}
	if s.Failing > 0 {
		s.Attention = append(s.Attention, fmt.Sprintf("%d rows failing to publish", s.Failing))
	}
	if !t.Paused && s.OldestDueAgeS > StaleDue.Seconds() {
		s.Attention = append(s.Attention, fmt.Sprintf("an event due for %s", time.Duration(s.OldestDueAgeS*float64(time.Second)).Round(time.Second)))
	}
	return s
}

// parked counts s's parked events (groups, every tenant's). Parked events
// of a tenant whose database answers are sent back within a second or
// two: still there after StaleDue, nothing sends them (no member with
// consumers alive) or their partition does not take them.
func parked(s *Status, groups []pgparked.Group, cmd string) {
	for _, g := range groups {
		if g.TenantID != s.ID {
			continue
		}
		s.Parked += g.Parked
		s.ParkedAgeS = max(s.ParkedAgeS, time.Since(g.Since).Seconds())
	}
	if s.Parked > 0 && s.Error == "" && s.ParkedAgeS > StaleDue.Seconds() {
		s.Attention = append(s.Attention, fmt.Sprintf("%d events parked out of ordered partitions for %s while its database answers (are the fleet's consumers running? %s status)",
			s.Parked, time.Duration(s.ParkedAgeS*float64(time.Second)).Round(time.Second), cmd))
	}
}
