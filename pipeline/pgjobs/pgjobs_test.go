package pgjobs_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgjobs"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A job reports its progress and its end; a confirmation starts one job
// only; a running job that stopped reporting (its process stopped) reads
// as interrupted, never as running forever.
func TestJobsReportAndAnInterruptedOneSaysSo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	id, err := pgjobs.Start(ctx, pool, "poison.discard", "group g", "ops", "run-1", "nonce-1", 1500)
	require.NoError(t, err)
	_, err = pgjobs.Start(ctx, pool, "poison.discard", "group g", "ops", "run-2", "nonce-1", 1500)
	require.ErrorIs(t, err, pgjobs.ErrConfirmationUsed)

	require.NoError(t, pgjobs.Progress(ctx, pool, id, 500, 0))
	j, err := pgjobs.Get(ctx, pool, id)
	require.NoError(t, err)
	require.Equal(t, pgjobs.Running, j.State)
	require.Equal(t, 500, j.Done)

	_, err = pool.Exec(ctx, `UPDATE ferry_jobs SET updated_at = now() - interval '2 minutes' WHERE id = $1`, id)
	require.NoError(t, err)
	j, err = pgjobs.Get(ctx, pool, id)
	require.NoError(t, err)
	require.Equal(t, pgjobs.Interrupted, j.State, "a job that stopped reporting")

	other, err := pgjobs.Start(ctx, pool, "poison.requeue", "ids 1,2", "ops", "run-3", "", 2)
	require.NoError(t, err)
	require.Error(t, pgjobs.Finish(ctx, pool, other, pgjobs.Running, 0, 0, ""), "a job ends done or failed")
	require.NoError(t, pgjobs.Finish(ctx, pool, other, pgjobs.Done, 2, 0, "requeued 2 message(s)"))
	j, err = pgjobs.Get(ctx, pool, other)
	require.NoError(t, err)
	require.Equal(t, pgjobs.Done, j.State)
	require.NotNil(t, j.FinishedAt)
	jobs, err := pgjobs.List(ctx, pool, 10)
	require.NoError(t, err)
	require.Len(t, jobs, 2)
	_, err = pgjobs.Get(ctx, pool, 424242)
	require.ErrorIs(t, err, pgjobs.ErrNotFound)
}
