package pgsession_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgsession"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A session is what the server keeps: it names who logged in, lives until
// it expires, is ended by its id wherever its cookie was copied, ends
// when idle past the limit, and an unknown id is no session.
func TestSessionsLiveExpireAndEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)

	s, err := pgsession.Start(ctx, pool, "oncall@corp.example", time.Hour)
	require.NoError(t, err)
	require.Len(t, s.ID, 32)
	require.WithinDuration(t, time.Now().Add(time.Hour), s.ExpiresAt, time.Minute)
	got, err := pgsession.Get(ctx, pool, s.ID, 0)
	require.NoError(t, err)
	require.Equal(t, "oncall@corp.example", got.Identity)

	other, err := pgsession.Start(ctx, pool, "oncall@corp.example", time.Hour)
	require.NoError(t, err)
	require.NotEqual(t, s.ID, other.ID, "every login its own id")

	require.NoError(t, pgsession.End(ctx, pool, s.ID))
	_, err = pgsession.Get(ctx, pool, s.ID, 0)
	require.ErrorIs(t, err, pgsession.ErrNone, "ended wherever its cookie was copied")
	require.NoError(t, pgsession.End(ctx, pool, s.ID), "ending it again is no error")
	_, err = pgsession.Get(ctx, pool, "no-such-id", 0)
	require.ErrorIs(t, err, pgsession.ErrNone)

	// Idle past the limit: gone, though it has not expired.
	time.Sleep(50 * time.Millisecond)
	_, err = pgsession.Get(ctx, pool, other.ID, 10*time.Millisecond)
	require.ErrorIs(t, err, pgsession.ErrNone)
	_, err = pgsession.Get(ctx, pool, other.ID, time.Minute)
	require.NoError(t, err, "within the idle limit it lives on")

	// Expired: gone, and the next login removes it.
	short, err := pgsession.Start(ctx, pool, "ops", time.Millisecond)
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond)
	_, err = pgsession.Get(ctx, pool, short.ID, 0)
	require.ErrorIs(t, err, pgsession.ErrNone)
}
