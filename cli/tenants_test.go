package cli_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The tenant registry through the command line, as an operator adds a
// tenant: add migrates the tenant's schema before registering it, and
// refuses what would break the fleet before writing anything; pause and
// limit show in list; migrate reports each tenant's versions and names the
// one whose database does not answer; every change is audited.
func TestTenantsCommands(t *testing.T) {
	ctx := context.Background()
	control := pipelinetest.Schema(t)
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", control)
	// The outbox's name as the suite runs it (the renamed-outbox CI step
	// names it otherwise): the commands read FERRY_OUTBOX_TABLE.
	tbl, err := ferrytest.OutboxTable()
	require.NoError(t, err)
	t.Setenv("FERRY_OUTBOX_TABLE", tbl.Name())
	tenantSchema := pipelinetest.UniqueName("ferry_test_tenant_")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgdb.Open(ctx, pgdb.Config{URL: pipelinetest.DatabaseURL()})
		require.NoError(t, err)
		defer admin.Close()
		require.NoError(t, pgdb.DropSchema(ctx, admin, tenantSchema))
	})
	ferry := func(args ...string) (int, string) {
		var out, errs bytes.Buffer
		code := cli.New(cli.Options{}).Run(ctx, args, &out, &errs)
		return code, out.String() + errs.String()
	}

	code, out := ferry("tenants", "add", "acme", "--schema", tenantSchema)
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "acme: ferry at ")
	require.Contains(t, out, "added tenant acme")
	pool := pipelinetest.Pool(t, tenantSchema, "ferry-test")
	missing, err := migrations.MissingTables(ctx, pool, migrations.ReadTables)
	require.NoError(t, err)
	require.Empty(t, missing, "add migrated the tenant's schema")
	// What a service whose outbox has another name does once migrated
	// (the suite's rig, as for its own schemas).
	require.NoError(t, ferrytest.RenameOutbox(ctx, pool, tbl))

	code, out = ferry("tenants", "add", "acme", "--schema", tenantSchema+"_2")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "registered already")
	for _, self := range [][]string{{}, {"--schema", control}} {
		code, out = ferry(append([]string{"tenants", "add", "self"}, self...)...)
		require.Equal(t, 2, code, out)
		require.Contains(t, out, "control database's own schema")
	}
	code, out = ferry("tenants", "add", "secret", "--database-url", "postgres://ferry:${FERRY_TEST_UNSET_PASSWORD}@127.0.0.1/db")
	require.Equal(t, 2, code, out)
	require.Contains(t, out, "FERRY_TEST_UNSET_PASSWORD")
	code, out = ferry("tenants", "add", "Not Valid", "--schema", "x")
	require.Equal(t, 2, code, out)

	require.Equal(t, 0, first(ferry("tenants", "pause", "acme", "--reason", "migrating its data")))
	require.Equal(t, 0, first(ferry("tenants", "limit", "acme", "--relay-rate", "50", "--max-handlers", "2")))
	code, out = ferry("tenants", "list")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "migrating its data")
	require.Contains(t, out, "50/s")
	code, out = ferry("tenants", "pause", "nobody")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "no tenant with this id")

	// A tenant whose server does not answer: migrate names it, migrates
	// the others, and fails.
	code, out = ferry("tenants", "add", "ghost", "--database-url", "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=2", "--no-migrate")
	require.Equal(t, 0, code, out)
	code, out = ferry("tenants", "migrate")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "ghost: FAILED")
	require.Regexp(t, `acme: ferry at \d{5}`, out)
	require.Contains(t, out, "1 of 2 tenants failed: ghost")

	// status: the ghost's database is out of reach, no fleet member is
	// alive, and acme is paused: exit 3, each reason named.
	code, out = ferry("tenants", "status")
	require.Equal(t, cli.ExitAttention, code, out)
	require.Contains(t, out, "its database is out of reach")
	require.Regexp(t, `acme\s+paused\s+0\s+0`, out)
	code, out = ferry("tenants", "status", "--tenant", "acme", "--json")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, `"pending": 0`)

	// ferry status of a fleet sums the tenants up and names the one
	// that needs a human, as one item.
	t.Setenv("FERRY_TENANTS", "true")
	code, out = ferry("status")
	require.Equal(t, cli.ExitAttention, code, out)
	require.Contains(t, out, "tenants: 2 (1 paused), 0 fleet member(s) alive, 1 need a human")
	require.Contains(t, out, "1 tenant(s) need a human: ghost (no fleet member alive (FERRY_TENANTS=true on a relay); its database is out of reach); ferry tenants status")
	code, out = ferry("status", "--json")
	require.Equal(t, cli.ExitAttention, code, out)
	require.Contains(t, out, `"kind": "tenants"`)
	require.Contains(t, out, `"target": "ghost"`)

	require.Equal(t, 0, first(ferry("tenants", "remove", "ghost")))
	code, out = ferry("status")
	require.Contains(t, out, "tenants: 1 (1 paused), 0 fleet member(s) alive, 0 need a human")
	require.NotContains(t, out, "tenant(s) need a human:")
	t.Setenv("FERRY_TENANTS", "false")
	admin := pipelinetest.Pool(t, control, "ferry-test")
	ts, err := pgtenants.List(ctx, admin)
	require.NoError(t, err)
	require.Len(t, ts, 1)
	require.Equal(t, "acme", ts[0].ID)
	require.True(t, ts[0].Paused)
	require.Equal(t, 2, ts[0].MaxHandlers)
	for action, n := range map[string]int{pgtenants.AddAction: 2, pgtenants.PauseAction: 1, pgtenants.LimitAction: 1, pgtenants.RemoveAction: 1} {
		require.Len(t, pipelinetest.Audited(t, admin, action), n, action)
	}
	code, out = ferry("tenants", "list", "--json")
	require.Equal(t, 0, code, out)
	require.True(t, strings.HasPrefix(strings.TrimSpace(out), "["), out)
	require.Contains(t, out, fmt.Sprintf("%q", tenantSchema))
}

func first(code int, _ string) int { return code }
