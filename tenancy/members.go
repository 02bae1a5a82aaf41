package tenancy

import (
	"context"
	"hash/fnv"
	"slices"
	"strings"

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
// is on: the instances whose heartbeat is recent and names Component.
func Members(ctx context.Context, control *pgxpool.Pool) ([]string, error) {
	is, err := pgstatus.Instances(ctx, control)
	if err != nil {
		return nil, err
	}
	var members []string
	for _, i := range is {
		if i.Alive && slices.Contains(strings.Split(i.Components, ","), Component) {
			members = append(members, i.ID)
		}
	}
	slices.Sort(members)
	return members, nil
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
