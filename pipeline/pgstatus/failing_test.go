package pgstatus_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// One rule for "failing": status, the console's overview and failing page
// (the operator), and the view ferry_outbox_failing give one count. Status
// counted rows tried more than 5 times, the console rows with an error:
// the overview showed both numbers.
func TestOneRuleForFailing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	later := time.Now().Add(time.Hour)
	pipelinetest.InsertOutbox(t, pool, testTable,
		pipelinetest.OutboxRow{AggregateID: "a", Topic: "t", Attempts: 2, LastError: "NOT_FOUND", AvailableAt: later, Slow: true},
		pipelinetest.OutboxRow{AggregateID: "b", Topic: "t", Attempts: 9, LastError: "NOT_FOUND", AvailableAt: later, Slow: true},
		pipelinetest.OutboxRow{AggregateID: "c", Topic: "t"}, // pending, never tried
		pipelinetest.OutboxRow{AggregateID: "d", Topic: pipeline.RetryTopic, AvailableAt: later},
		pipelinetest.OutboxRow{AggregateID: "e", Topic: "t", Attempts: 7, LastError: "old", Dispatched: true})
	rep, err := pgstatus.Collect(ctx, pool, testTable, pgstatus.DefaultAttemptsThreshold)
	require.NoError(t, err)
	ops, err := pgoutbox.NewOperator(pool, testTable)
	require.NoError(t, err)
	console, err := ops.FailingCount(ctx)
	require.NoError(t, err)
	var view int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+testTable.View(pgoutbox.StateFailing)).Scan(&view))
	require.Equal(t, 2, rep.FailingCount)
	require.Equal(t, rep.FailingCount, console)
	require.Equal(t, rep.FailingCount, view)
	require.Len(t, rep.Failing, 1, "of those, tried more than 5 times: the one that needs a human")
	require.Equal(t, "b", rep.Failing[0].AggregateID)
}
