package pgcdc_test

import (
	"context"
	"io/fs"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// `migrate up` to the partitioned outbox (00025) while the CDC relay
// streams: the publication it made on the table of before follows the
// outbox to the partitioned table, publishing under its name, and every
// event written before, during and after arrives once, in order per
// aggregate; nothing is left for a safety net.
func TestPartitionMigrationKeepsTheStream(t *testing.T) {
	pipelinetest.RequireDefaultOutbox(t)
	r := newRig(t)
	ctx := context.Background()
	db := pgdb.SQLDB(r.pool)
	t.Cleanup(func() { _ = db.Close() })
	pipelinetest.MigrateDownTo(t, db, 24) // the outbox before 00025

	s, _ := r.start(t, r.pool, r.relay(t, r.pool, "", pgoutbox.RelayConfig{}), r.cdcConfig())
	require.Eventually(t, func() bool { return s.Stats().Active }, 20*time.Second, 20*time.Millisecond)
	r.insert(t, 0, 200, 5, 10)
	got := r.collect(t, 200, 30*time.Second)

	// One transaction per event, across the swap.
	writing := make(chan error, 1)
	go func() {
		for i := 200; i < 400; i++ {
			if _, err := r.pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, payload_raw, message_uuid)
				VALUES ('agg-' || ($1::int % 5), $2, jsonb_build_object('seq', $1::int), convert_to(jsonb_build_object('seq', $1::int)::text, 'UTF8'), 'cdc-' || $1::int)`,
				i, orderedTopic); err != nil {
				writing <- err
				return
			}
		}
		writing <- nil
	}()
	n, err := migrations.Up(ctx, db)
	require.NoError(t, err)
	require.Equal(t, ferryMigrations(t)-24, n, "00025 to the newest")
	require.NoError(t, <-writing)
	var viaRoot, parted bool
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT pubviaroot, (SELECT relkind = 'p' FROM pg_class WHERE oid = 'outbox'::regclass)
		FROM pg_publication WHERE pubname = $1`, r.slot).Scan(&viaRoot, &parted))
	require.True(t, parted)
	require.True(t, viaRoot, "the publication publishes the partitions' inserts under the outbox's name")

	r.insert(t, 400, 200, 5, 10)
	got = append(got, r.collect(t, 400, 60*time.Second)...)
	requireInOrder(t, got, 0, 600)
	r.awaitPending(t, 0, 30*time.Second)
}

// ferryMigrations is how many migrations Ferry's set holds.
func ferryMigrations(t *testing.T) int {
	t.Helper()
	files, err := fs.Glob(migrations.FS, "*.sql")
	require.NoError(t, err)
	return len(files)
}
