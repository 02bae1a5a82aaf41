package pgoutbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgfilter"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The operator's reads and actions share one definition of a failing row
// and of a durable retry, act only on the kind they name, and write the
// audit entry (with the ids) in the action's transaction.
func TestOperatorActsOnWhatItNamesAndAuditsInTheSameTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	hour := time.Now().Add(time.Hour)
	var seedRows []pipelinetest.OutboxRow
	for g := 1; g <= 5; g++ {
		seedRows = append(seedRows, pipelinetest.OutboxRow{Topic: "orders.placed", AggregateID: fmt.Sprintf("a%d", g), MessageUUID: watermill.NewUUID(),
			Attempts: 3, LastError: "broker refused: NOT_FOUND 404", AvailableAt: hour})
	}
	for g := 1; g <= 3; g++ {
		seedRows = append(seedRows, pipelinetest.OutboxRow{Topic: pipeline.RetryTopic, AggregateID: fmt.Sprintf("r%d", g), MessageUUID: watermill.NewUUID(),
			Headers: map[string]string{pipeline.MetaRetryQueue: "mail", pipeline.MetaLastError: "smtp 451 try later"}, AvailableAt: hour})
	}
	seedRows = append(seedRows, pipelinetest.OutboxRow{Topic: "orders.placed", AggregateID: "ok"})
	ids := pipelinetest.InsertOutbox(t, pool, testTable, seedRows...)

	ops, err := pgoutbox.NewOperator(pool, testTable)
	require.NoError(t, err)
	n, err := ops.FailingCount(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, n)
	groups, err := ops.FailingGroups(ctx, pgfilter.Filter{}, 10)
	require.NoError(t, err)
	require.Len(t, groups, 1)
	require.Equal(t, 5, groups[0].Count)
	rows, err := ops.FailingRows(ctx, pgfilter.Filter{AggregateID: "a2"}, 10)
	require.NoError(t, err)
	require.Len(t, rows, 1)

	failing := pgoutbox.Stuck{Kind: pgoutbox.Failing, Fingerprint: groups[0].Fingerprint}
	require.Error(t, pgoutbox.Stuck{Kind: "other", Fingerprint: "x"}.Validate())
	require.Error(t, pgoutbox.Stuck{Kind: pgoutbox.Failing}.Validate())
	_, err = ops.Discard(ctx, failing, pgoutbox.By{})
	require.ErrorContains(t, err, "actor")

	// A retry's id named as a failing row is not acted on.
	retryID := ids[5]
	acted, err := ops.Discard(ctx, pgoutbox.Stuck{Kind: pgoutbox.Failing, IDs: []int64{retryID}}, pgoutbox.By{Actor: "ops@test"})
	require.NoError(t, err)
	require.Empty(t, acted.IDs)

	acted, err = ops.RetryNow(ctx, failing, pgoutbox.By{Actor: "ops@test"})
	require.NoError(t, err)
	require.Len(t, acted.IDs, 5)
	require.Equal(t, 6, countWhere(t, pool, "topic = 'orders.placed' AND available_at <= now()"))

	var fp string
	require.NoError(t, pool.QueryRow(ctx, `SELECT ferry_fingerprint($1)`, rowWhere(t, pool, "id = $1", retryID).Headers[pipeline.MetaLastError]).Scan(&fp))
	retries := pgoutbox.Stuck{Kind: pgoutbox.Retrying, Handler: "mail", Fingerprint: fp}
	n, err = ops.Count(ctx, retries)
	require.NoError(t, err)
	require.Equal(t, 3, n)

	// The audit refuses: the discard is undone with it.
	_, err = pool.Exec(ctx, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'audit refused'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON ferry_audit_log FOR EACH ROW EXECUTE FUNCTION refuse()`)
	require.NoError(t, err)
	_, err = ops.Discard(ctx, retries, pgoutbox.By{Actor: "ops@test"})
	require.ErrorContains(t, err, "audit refused")
	n, err = ops.Count(ctx, retries)
	require.NoError(t, err)
	require.Equal(t, 3, n, "no discard without its audit")
	_, err = pool.Exec(ctx, `DROP TRIGGER refuse ON ferry_audit_log`)
	require.NoError(t, err)

	acted, err = ops.Discard(ctx, retries, pgoutbox.By{Actor: "ops@test"})
	require.NoError(t, err)
	require.Len(t, acted.IDs, 3)
	require.Len(t, pipelinetest.Audited(t, pool, ""), 2, "one entry per action that did something")
	discards := pipelinetest.Audited(t, pool, "outbox.retrying.discard")
	require.Len(t, discards, 1)
	var audited []int64
	for _, id := range discards[0].Detail["ids"].([]any) {
		audited = append(audited, int64(id.(float64)))
	}
	require.ElementsMatch(t, acted.IDs, audited)
}
