package pgpause_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgpause"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A pause names a route (not a partition), needs an actor, happens once
// until resumed, and both are audited.
func TestPauseAndResumeAreAuditedOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	require.ErrorContains(t, pgpause.Set(ctx, pool, "payments.charge@3", "ops", ""), "not a route's name")
	require.Error(t, pgpause.Set(ctx, pool, "payments.charge", "", ""), "an actor is required")
	require.NoError(t, pgpause.Set(ctx, pool, "payments.charge", "ops", "provider incident"))
	require.ErrorIs(t, pgpause.Set(ctx, pool, "payments.charge", "ops", ""), pgpause.ErrPaused)
	paused, err := pgpause.Source{Pool: pool}.Paused(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]bool{"payments.charge": true}, paused)
	list, err := pgpause.List(ctx, pool)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, "provider incident", list[0].Reason)
	require.NoError(t, pgpause.Clear(ctx, pool, "payments.charge", "ops"))
	require.ErrorIs(t, pgpause.Clear(ctx, pool, "payments.charge", "ops"), pgpause.ErrNotPaused)
	require.Len(t, pipelinetest.Audited(t, pool, "handler.pause"), 1)
	require.Len(t, pipelinetest.Audited(t, pool, "handler.resume"), 1)
}
