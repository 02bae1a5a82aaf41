package app

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// A start waits out a database that drops its connections (a backend
// terminated by an operator or a failover, SQLSTATE 57P01) and goes on
// once it answers; anything else fails the start at once.
func TestAStartWaitsOutAnOutage(t *testing.T) {
	terminated := &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
	calls := 0
	err := waitOutOutage(context.Background(), func() error {
		if calls++; calls < 3 {
			return terminated
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 3, calls)

	missing := &pgconn.PgError{Code: "42P01", Message: `relation "ferry_instances" does not exist`}
	calls = 0
	err = waitOutOutage(context.Background(), func() error { calls++; return missing })
	require.True(t, errors.Is(err, missing))
	require.Equal(t, 1, calls, "not an outage: no retry")
}
