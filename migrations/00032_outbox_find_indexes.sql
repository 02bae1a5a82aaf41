-- +goose NO TRANSACTION
-- +goose Up
-- "Find a message" (pgstatus.Find: ferry find, the console's search,
-- intent_status) looks an id up in the outbox and its archive as a message
-- id (message_uuid, or a requeued or retried message's original id in
-- headers->>'ferry_message_id'), an aggregate id or a correlation id.
-- Only aggregate_id was indexed: the OR of the four keys walked every
-- row of every partition backwards along its primary key (ORDER BY id
-- DESC LIMIT), 465 ms at 1,000,000 rows and ten times that at 10 million,
-- on the pool the consumers share. With the three indexes below the
-- planner takes a BitmapOr: 19.6 ms for the whole Find at 1,000,000 rows
-- (ferry bench --scenario search_load measures what searches cost the
-- consumers; docs/performance.md says what each insert pays for them).
-- A requeued or retried message's original id is on few rows: its index
-- holds only those (partial; Table.Find asks for the key), so that the
-- other inserts do not pay for it.
--
-- Online, as 00024 and 00025: each partition's index is built
-- CONCURRENTLY (writers go on), then attached to an index made ON ONLY
-- the partitioned table, which is valid once every partition's is
-- attached; a partition created later gets its own with it. Re-runnable:
-- IF NOT EXISTS, and an attach of an attached index does nothing.

-- A partition that holds no row (a new schema's, a week to come) takes its
-- indexes at once, in one short transaction: CREATE INDEX CONCURRENTLY
-- waits, twice, for every transaction of the database older than it,
-- however unrelated (a long report, another service's batch), which an
-- empty table need not. The statements after it then find those indexes
-- there (IF NOT EXISTS) and build only the others, concurrently.
-- +goose StatementBegin
DO $$
DECLARE
  p text;
  has_rows boolean;
BEGIN
  CREATE INDEX IF NOT EXISTS outbox_message_uuid_idx ON ONLY outbox (message_uuid);
  CREATE INDEX IF NOT EXISTS outbox_correlation_id_idx ON ONLY outbox ((headers->>'correlation_id'));
  CREATE INDEX IF NOT EXISTS outbox_ferry_message_id_idx ON ONLY outbox ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
  FOR p IN SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox'::regclass LOOP
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', p) INTO STRICT has_rows;
    CONTINUE WHEN has_rows;
    EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON %I (message_uuid)', p || '_message_uuid_idx', p);
    EXECUTE format('ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION %I', p || '_message_uuid_idx');
    EXECUTE format($q$CREATE INDEX IF NOT EXISTS %I ON %I ((headers->>'correlation_id'))$q$, p || '_correlation_id_idx', p);
    EXECUTE format('ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION %I', p || '_correlation_id_idx');
    EXECUTE format($q$CREATE INDEX IF NOT EXISTS %I ON %I ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id'$q$, p || '_ferry_message_id_idx', p);
    EXECUTE format('ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION %I', p || '_ferry_message_id_idx');
  END LOOP;
  IF NOT EXISTS (SELECT 1 FROM outbox_archive) THEN
    CREATE INDEX IF NOT EXISTS outbox_archive_message_uuid_idx ON outbox_archive (message_uuid);
    CREATE INDEX IF NOT EXISTS outbox_archive_correlation_id_idx ON outbox_archive ((headers->>'correlation_id'));
    CREATE INDEX IF NOT EXISTS outbox_archive_ferry_message_id_idx ON outbox_archive ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
    CREATE INDEX IF NOT EXISTS outbox_archive_aggregate_id_idx ON outbox_archive (aggregate_id);
  END IF;
END
$$;
-- +goose StatementEnd
CREATE INDEX IF NOT EXISTS outbox_message_uuid_idx ON ONLY outbox (message_uuid);
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_legacy_message_uuid_idx ON outbox_legacy (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_legacy_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p00_message_uuid_idx ON outbox_p00 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p00_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p01_message_uuid_idx ON outbox_p01 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p01_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p02_message_uuid_idx ON outbox_p02 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p02_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p03_message_uuid_idx ON outbox_p03 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p03_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p04_message_uuid_idx ON outbox_p04 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p04_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p05_message_uuid_idx ON outbox_p05 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p05_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p06_message_uuid_idx ON outbox_p06 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p06_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p07_message_uuid_idx ON outbox_p07 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p07_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p08_message_uuid_idx ON outbox_p08 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p08_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p09_message_uuid_idx ON outbox_p09 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p09_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p10_message_uuid_idx ON outbox_p10 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p10_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p11_message_uuid_idx ON outbox_p11 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p11_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p12_message_uuid_idx ON outbox_p12 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p12_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p13_message_uuid_idx ON outbox_p13 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p13_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p14_message_uuid_idx ON outbox_p14 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p14_message_uuid_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p15_message_uuid_idx ON outbox_p15 (message_uuid);
ALTER INDEX outbox_message_uuid_idx ATTACH PARTITION outbox_p15_message_uuid_idx;
CREATE INDEX IF NOT EXISTS outbox_correlation_id_idx ON ONLY outbox ((headers->>'correlation_id'));
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_legacy_correlation_id_idx ON outbox_legacy ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_legacy_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p00_correlation_id_idx ON outbox_p00 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p00_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p01_correlation_id_idx ON outbox_p01 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p01_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p02_correlation_id_idx ON outbox_p02 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p02_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p03_correlation_id_idx ON outbox_p03 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p03_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p04_correlation_id_idx ON outbox_p04 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p04_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p05_correlation_id_idx ON outbox_p05 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p05_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p06_correlation_id_idx ON outbox_p06 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p06_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p07_correlation_id_idx ON outbox_p07 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p07_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p08_correlation_id_idx ON outbox_p08 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p08_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p09_correlation_id_idx ON outbox_p09 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p09_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p10_correlation_id_idx ON outbox_p10 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p10_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p11_correlation_id_idx ON outbox_p11 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p11_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p12_correlation_id_idx ON outbox_p12 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p12_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p13_correlation_id_idx ON outbox_p13 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p13_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p14_correlation_id_idx ON outbox_p14 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p14_correlation_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p15_correlation_id_idx ON outbox_p15 ((headers->>'correlation_id'));
ALTER INDEX outbox_correlation_id_idx ATTACH PARTITION outbox_p15_correlation_id_idx;
CREATE INDEX IF NOT EXISTS outbox_ferry_message_id_idx ON ONLY outbox ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_legacy_ferry_message_id_idx ON outbox_legacy ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_legacy_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p00_ferry_message_id_idx ON outbox_p00 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p00_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p01_ferry_message_id_idx ON outbox_p01 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p01_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p02_ferry_message_id_idx ON outbox_p02 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p02_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p03_ferry_message_id_idx ON outbox_p03 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p03_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p04_ferry_message_id_idx ON outbox_p04 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p04_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p05_ferry_message_id_idx ON outbox_p05 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p05_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p06_ferry_message_id_idx ON outbox_p06 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p06_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p07_ferry_message_id_idx ON outbox_p07 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p07_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p08_ferry_message_id_idx ON outbox_p08 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p08_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p09_ferry_message_id_idx ON outbox_p09 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p09_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p10_ferry_message_id_idx ON outbox_p10 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p10_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p11_ferry_message_id_idx ON outbox_p11 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p11_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p12_ferry_message_id_idx ON outbox_p12 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p12_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p13_ferry_message_id_idx ON outbox_p13 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p13_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p14_ferry_message_id_idx ON outbox_p14 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p14_ferry_message_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_p15_ferry_message_id_idx ON outbox_p15 ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
ALTER INDEX outbox_ferry_message_id_idx ATTACH PARTITION outbox_p15_ferry_message_id_idx;
-- The archive (discarded rows and a retention's pending ones) is searched alike.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_archive_message_uuid_idx ON outbox_archive (message_uuid);
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_archive_correlation_id_idx ON outbox_archive ((headers->>'correlation_id'));
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_archive_ferry_message_id_idx ON outbox_archive ((headers->>'ferry_message_id')) WHERE headers ? 'ferry_message_id';
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_archive_aggregate_id_idx ON outbox_archive (aggregate_id);

-- +goose Down
DROP INDEX IF EXISTS outbox_message_uuid_idx;
DROP INDEX IF EXISTS outbox_correlation_id_idx;
DROP INDEX IF EXISTS outbox_ferry_message_id_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_archive_message_uuid_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_archive_correlation_id_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_archive_ferry_message_id_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_archive_aggregate_id_idx;
