package pgtenants_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgtenants"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A URL names its secrets as ${NAME}: filled from the environment, an
// unset one named in the error; a '$' of the URL's own stays.
func TestExpandReadsTheProcesssSecrets(t *testing.T) {
	t.Setenv("FERRY_TEST_TENANT_PASSWORD", "s3cr$t")
	got, err := pgtenants.Expand("postgres://ferry:${FERRY_TEST_TENANT_PASSWORD}@db/a$b")
	require.NoError(t, err)
	require.Equal(t, "postgres://ferry:s3cr$t@db/a$b", got)
	_, err = pgtenants.Expand("postgres://ferry:${FERRY_TEST_TENANT_UNSET}@db/x")
	require.ErrorContains(t, err, "FERRY_TEST_TENANT_UNSET")
	require.NotContains(t, err.Error(), "s3cr")
}

func TestValidateRefusesWhatTheFleetCannotServe(t *testing.T) {
	for _, bad := range []pgtenants.Tenant{
		{ID: ""}, {ID: "Acme"}, {ID: "-acme"}, {ID: "acme corp"}, {ID: string(make([]byte, 64))},
		{ID: "acme", Schema: "pg_catalog"},
		{ID: "acme", DatabaseURL: "postgres://x:${UNSET_FOR_SURE_42}@h/db"},
		{ID: "acme", DatabaseURL: "postgres://h:notaport/db"},
		{ID: "acme", Schema: "s", RelayRate: -1},
		{ID: "acme", Schema: "s", MaxHandlers: -2},
	} {
		require.Error(t, bad.Validate(), "%+v", bad)
	}
	require.NoError(t, pgtenants.Tenant{ID: "acme_2-eu", Schema: "tenant_acme", RelayRate: 50, MaxHandlers: 4}.Validate())
	require.Equal(t, "postgres://ferry:xxxxx@db/a, schema s", pgtenants.Tenant{DatabaseURL: "postgres://ferry:pw@db/a", Schema: "s"}.Location())
}

// Every change of the registry changes its version (what a reload reads
// before reading the rows), and is refused for an unknown tenant.
func TestTheRegistrysVersionFollowsEveryChange(t *testing.T) {
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	versions := []pgtenants.Version{}
	read := func() {
		v, err := pgtenants.ReadVersion(ctx, pool)
		require.NoError(t, err)
		for _, seen := range versions {
			require.NotEqual(t, seen, v, "a change left the version as it was")
		}
		versions = append(versions, v)
	}
	read()
	require.NoError(t, pgtenants.Add(ctx, pool, pgtenants.Tenant{ID: "acme", Schema: "tenant_acme"}, "test"))
	read()
	require.NoError(t, pgtenants.Pause(ctx, pool, "acme", "test", "moving"))
	read()
	require.NoError(t, pgtenants.Limit(ctx, pool, "acme", 10, 2, "test"))
	read()
	require.NoError(t, pgtenants.Resume(ctx, pool, "acme", "test"))
	read()
	require.NoError(t, pgtenants.Add(ctx, pool, pgtenants.Tenant{ID: "bolt", Schema: "tenant_bolt"}, "test"))
	read()
	require.NoError(t, pgtenants.Remove(ctx, pool, "bolt", "test"))
	read()

	require.True(t, errors.Is(pgtenants.Pause(ctx, pool, "nobody", "test", ""), pgtenants.ErrNotFound))
	require.True(t, errors.Is(pgtenants.Add(ctx, pool, pgtenants.Tenant{ID: "acme", Schema: "other"}, "test"), pgtenants.ErrExists))
	require.True(t, errors.Is(pgtenants.Add(ctx, pool, pgtenants.Tenant{ID: "copy", Schema: "tenant_acme"}, "test"), pgtenants.ErrShared))
	acme, err := pgtenants.Get(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, 10.0, acme.RelayRate)
	require.False(t, acme.Paused)
}
