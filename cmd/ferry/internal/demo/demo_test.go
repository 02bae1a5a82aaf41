package demo_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/ferry-dev/ferry/cmd/ferry/internal/demo"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func TestDemo(t *testing.T) {
	t.Parallel()
	rmq := pipelinetest.Rabbit(t)
	schema := pipelinetest.UniqueName("ferry_demo_test_")
	t.Cleanup(func() {
		pool, err := pgdb.Open(context.Background(), pgdb.Config{URL: pipelinetest.DatabaseURL()})
		require.NoError(t, err)
		defer pool.Close()
		require.NoError(t, pgdb.DropSchema(context.Background(), pool, schema))
	})
	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), DatabaseSchema: schema, AMQP: rmq}

	var out strings.Builder
	rep, err := demo.Demo(context.Background(), cfg, &out, slog.New(slog.DiscardHandler))
	require.NoError(t, err, out.String())
	require.Equal(t, 3, rep.Orders)
	require.Equal(t, 1, rep.OrderReplaysDeduped)
	require.Equal(t, 3, rep.Charges)
	require.Equal(t, 3, rep.ChargeRequests)
	require.Equal(t, 3, rep.Mails)
	require.EqualValues(t, 7, rep.EventsRelayed)
	require.EqualValues(t, 1, rep.LedgerDuplicates)
	require.Contains(t, out.String(), "ok: every side effect happened exactly once")

	// A second run starts from a fresh schema.
	rep, err = demo.Demo(context.Background(), cfg, &out, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	require.Equal(t, 3, rep.Charges)
}
