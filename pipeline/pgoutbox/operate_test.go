package pgoutbox_test

import (
	"context"
	"testing"

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
	_, err := pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (topic, aggregate_id, payload, headers, attempts, last_error, available_at, message_uuid)
		SELECT 'orders.placed', 'a' || g, '{}', '{}', 3, 'broker refused: NOT_FOUND 404', now() + interval '1 hour', gen_random_uuid()::text FROM generate_series(1, 5) g`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (topic, aggregate_id, payload, headers, available_at, message_uuid)
		SELECT $1, 'r' || g, '{}', jsonb_build_object($2::text, 'mail', $3::text, 'smtp 451 try later'), now() + interval '1 hour', gen_random_uuid()::text
		FROM generate_series(1, 3) g`, pipeline.RetryTopic, pipeline.MetaRetryQueue, pipeline.MetaLastError)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (topic, aggregate_id, payload, headers) VALUES ('orders.placed', 'ok', '{}', '{}')`)
	require.NoError(t, err)

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
	var retryID int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT min(id) FROM `+outboxSQL+` WHERE topic = $1`, pipeline.RetryTopic).Scan(&retryID))
	acted, err := ops.Discard(ctx, pgoutbox.Stuck{Kind: pgoutbox.Failing, IDs: []int64{retryID}}, pgoutbox.By{Actor: "ops@test"})
	require.NoError(t, err)
	require.Empty(t, acted.IDs)

	acted, err = ops.RetryNow(ctx, failing, pgoutbox.By{Actor: "ops@test"})
	require.NoError(t, err)
	require.Len(t, acted.IDs, 5)
	var due int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxSQL+` WHERE topic = 'orders.placed' AND available_at <= now()`).Scan(&due))
	require.Equal(t, 6, due)

	var fp string
	require.NoError(t, pool.QueryRow(ctx, `SELECT ferry_fingerprint(headers->>$1) FROM `+outboxSQL+` WHERE id = $2`, pipeline.MetaLastError, retryID).Scan(&fp))
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
	var entries int
	var ids []int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM ferry_audit_log`).Scan(&entries))
	require.Equal(t, 2, entries, "one entry per action that did something")
	require.NoError(t, pool.QueryRow(ctx, `SELECT ARRAY(SELECT jsonb_array_elements_text(detail->'ids')::bigint) FROM ferry_audit_log WHERE action = 'outbox.retrying.discard'`).Scan(&ids))
	require.ElementsMatch(t, acted.IDs, ids)
}
