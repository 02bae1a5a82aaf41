package tenancy

import (
	"context"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// The fleet's members and which tenants each serves.

// readMembers lists the live fleet processes, this one included.
func (f *Fleet) readMembers(ctx context.Context) ([]string, error) {
	if f.cfg.Member == "" {
		return nil, nil
	}
	members, err := Members(ctx, f.control)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(members, f.cfg.Member) {
		members = append(members, f.cfg.Member)
		slices.Sort(members)
	}
	return members, nil
}

// Members are the live processes of the fleet whose control database pool
// is on: the instances whose heartbeat is recent and names Component, and
// that hold their member lock (holdMembership), or started less than
// MemberLockGrace ago.
func Members(ctx context.Context, control *pgxpool.Pool) ([]string, error) {
	is, err := pgstatus.Instances(ctx, control)
	if err != nil {
		return nil, err
	}
	var candidates []string
	young := map[string]bool{}
	for _, i := range is {
		if i.Alive && slices.Contains(strings.Split(i.Components, ","), Component) {
			candidates = append(candidates, i.ID)
			young[i.ID] = time.Since(i.StartedAt) < MemberLockGrace
		}
	}
	if len(candidates) == 0 {
		return nil, nil
	}
	rows, err := control.Query(ctx, `SELECT m FROM unnest($1::text[]) m WHERE EXISTS (SELECT 1 FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
		AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
		AND l.classid = hashtext('`+memberLockKey+`')::oid AND l.objid = hashtext(m)::oid)`, candidates)
	if err != nil {
		return nil, fmt.Errorf("reading the fleet members' locks: %w", err)
	}
	locked, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("reading the fleet members' locks: %w", err)
	}
	var members []string
	for _, id := range candidates {
		if young[id] || slices.Contains(locked, id) {
			members = append(members, id)
		}
	}
	slices.Sort(members)
	return members, nil
}

// memberLockKey names the session-level advisory lock each fleet member
// holds on the control database while it runs (with its id's hash): a
// process that dies (SIGKILL, a crash, a reset connection) loses it as
// soon as the server sees its session end, and the other members take its
// tenants at their next reload, instead of once its heartbeat is stale
// (pgstatus.AliveWithin, 15 s: a killed member's tenants waited that
// long). A member out of the server's sight without a reset (a black
// hole) keeps its lock until the server's keepalives end its session;
// its heartbeat going stale ends its membership first.
const memberLockKey = "ferry_fleet_member"

// MemberLockGrace is how long after its start a member counts without its
// lock: the lock is taken just after the heartbeat row is written.
const MemberLockGrace = 10 * time.Second

// memberLockRetry is how soon a member whose lock session was lost takes
// its lock again; meanwhile the others may serve its tenants too, which
// costs work, not correctness (a tenant's relays share its outbox's
// position lock).
const memberLockRetry = time.Second

// holdMembership holds this member's lock in a connection of its own
// until ctx ends, taking it again whenever its session is lost.
func (f *Fleet) holdMembership(ctx context.Context) {
	if f.cfg.Member == "" {
		return
	}
	lost := 0
	for ctx.Err() == nil {
		err := f.holdMemberLock(ctx)
		if ctx.Err() != nil {
			return
		}
		if lost++; lost == 1 || lost%60 == 0 {
			f.logger.Warn("the fleet member's lock on the control database was lost; taking it again (meanwhile the other members may serve this one's tenants too)",
				"error", err, "retry_in", memberLockRetry, "losses", lost)
		}
		select {
		case <-ctx.Done():
		case <-time.After(memberLockRetry):
		}
	}
}

// memberLockCheck is how often the member's lock session is checked.
const memberLockCheck = 5 * time.Second

func (f *Fleet) holdMemberLock(ctx context.Context) error {
	pc, err := f.control.Acquire(ctx)
	if err != nil {
		return err
	}
	// Out of the pool: the session is the lock.
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(hashtext('`+memberLockKey+`'), hashtext($1))`, f.cfg.Member); err != nil {
		return err
	}
	t := time.NewTicker(memberLockCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if _, err := conn.Exec(ctx, `SELECT 1`); err != nil {
			return err
		}
	}
}

// Owner is the member that serves tenant id: the one with the highest
// hash of (member, tenant), so that a member joining or leaving moves only
// the tenants it takes or had. "" without members.
func Owner(members []string, id string) string {
	best, bestScore := "", uint64(0)
	for _, m := range members {
		h := fnv.New64a()
		h.Write([]byte(m))
		h.Write([]byte{0})
		h.Write([]byte(id))
		if s := h.Sum64(); best == "" || s > bestScore {
			best, bestScore = m, s
		}
	}
	return best
}

// owns says whether this process serves tenant id (Owner).
func (f *Fleet) owns(id string) bool {
	return f.cfg.Member == "" || Owner(f.members, id) == f.cfg.Member
}
