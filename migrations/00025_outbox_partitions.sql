-- +goose NO TRANSACTION
-- +goose Up
-- Retention by whole partitions. Pruning the outbox with DELETE left one
-- dead tuple per row, the kind a long transaction keeps (see 00024), and
-- rewrote nothing it freed. The outbox becomes a table partitioned by
-- part, a week's slot in a ring of 16: a row's part is the week it was
-- written in (ferry_outbox_part(now()), Monday 00:00 UTC to Monday), and a
-- slot whose last week is past retention is emptied by TRUNCATE once its
-- pending rows (a far delay, a failing row) have moved to the current slot
-- (pgoutbox.ClearPartitions). A ring, not a partition per period created
-- ahead: every slot always exists, so no insert ever finds no partition to
-- go to, whatever happened to the process that would have created it.
--
-- Online: the table that holds today's rows is not copied. It becomes the
-- partition outbox_legacy (part = -1) of the new table, under the same
-- name "outbox", in one short transaction taken under a 500 ms
-- lock_timeout, retried; what is slow (validating the part constraint) is
-- done beforehand without blocking writers.
-- outbox_legacy is pruned row by row as before and emptied by TRUNCATE once
-- retention has passed since the upgrade.

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION ferry_outbox_part(t timestamptz) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  -- Weeks since the epoch's first Monday, modulo 16 (pgoutbox.PartitionOf).
  SELECT (floor((extract(epoch FROM t) + 259200) / 604800)::bigint % 16)::smallint
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
  tries int := 0;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass) = 'p' THEN
    RETURN; -- converted already
  END IF;
  LOOP
    BEGIN
      PERFORM set_config('lock_timeout', '500ms', true);
      -- A constant default: no rewrite, a catalog change.
      ALTER TABLE outbox ADD COLUMN IF NOT EXISTS part smallint NOT NULL DEFAULT -1;
      ALTER TABLE outbox_archive ADD COLUMN IF NOT EXISTS part smallint NULL;
      IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'outbox_legacy_part' AND conrelid = 'outbox'::regclass) THEN
        ALTER TABLE outbox ADD CONSTRAINT outbox_legacy_part CHECK (part = -1) NOT VALID;
      END IF;
      EXIT;
    EXCEPTION WHEN lock_not_available THEN
      tries := tries + 1;
      IF tries >= 240 THEN
        RAISE EXCEPTION 'could not lock the outbox for 2 minutes (a long transaction holds a lock on it: see pg_locks); run migrate up again';
      END IF;
      PERFORM pg_sleep(0.5);
    END;
  END LOOP;
  -- Scans the table under a lock that lets producers and relays work: it
  -- is what spares the attach below a scan under an exclusive lock.
  ALTER TABLE outbox VALIDATE CONSTRAINT outbox_legacy_part;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
  i int;
  p text;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass) = 'p' THEN
    RETURN;
  END IF;
  DROP TABLE IF EXISTS outbox_parted;
  CREATE TABLE outbox_parted (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY LIST (part);
  ALTER TABLE outbox_parted DROP CONSTRAINT outbox_legacy_part;
  ALTER TABLE outbox_parted ALTER COLUMN part SET DEFAULT ferry_outbox_part(now());
  -- The same indexes as the legacy table's (00024): the attach adopts
  -- them instead of building new ones under its lock. The primary key is
  -- each partition's own, on id alone: a key of the partitioned table
  -- would have to hold part, and with (id, part) the planner no longer
  -- knows that an id is one row (a relay's lookup of 500 ids by id became
  -- a scan of the whole partition on a table not analyzed yet). Ids come
  -- from one sequence, and a row keeps its id when it moves.
  CREATE INDEX outbox_parted_tx_idx ON outbox_parted (tx, id);
  CREATE INDEX outbox_parted_aggregate_tx_idx ON outbox_parted (aggregate_id, tx);
  CREATE INDEX outbox_parted_slow_available_at_idx ON outbox_parted (available_at)
    WHERE dispatched_at IS NULL AND (slow OR tx IS NULL);
  CREATE INDEX outbox_parted_slow_aggregate_idx ON outbox_parted (aggregate_id, id)
    WHERE dispatched_at IS NULL AND (slow OR tx IS NULL);
  FOR i IN 0..15 LOOP
    p := 'outbox_p' || lpad(i::text, 2, '0');
    EXECUTE format('CREATE TABLE %I PARTITION OF outbox_parted FOR VALUES IN (%s)', p, i);
    EXECUTE format('ALTER TABLE %I ADD PRIMARY KEY (id)', p);
    -- The indexes the partition got, named as the parent's.
    EXECUTE format('ALTER INDEX %I RENAME TO %I', p || '_tx_id_idx', p || '_tx_idx');
    EXECUTE format('ALTER INDEX %I RENAME TO %I', p || '_aggregate_id_tx_idx', p || '_aggregate_tx_idx');
    EXECUTE format('ALTER INDEX %I RENAME TO %I', p || '_available_at_idx', p || '_slow_available_at_idx');
    EXECUTE format('ALTER INDEX %I RENAME TO %I', p || '_aggregate_id_id_idx', p || '_slow_aggregate_idx');
  END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
  tries int := 0;
  pubs text[];
  pub text;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass) = 'p' THEN
    RETURN;
  END IF;
  LOOP
    BEGIN
      PERFORM set_config('lock_timeout', '500ms', true);
      LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;
      -- Publications of the outbox (the CDC relay's) follow it to the new
      -- table, publishing under its name rather than its partitions'.
      SELECT coalesce(array_agg(p.pubname), '{}') INTO pubs FROM pg_publication p
        JOIN pg_publication_rel r ON r.prpubid = p.oid WHERE r.prrelid = 'outbox'::regclass;
      ALTER TABLE outbox RENAME CONSTRAINT outbox_pkey TO outbox_legacy_pkey;
      ALTER INDEX outbox_tx_idx RENAME TO outbox_legacy_tx_idx;
      ALTER INDEX outbox_aggregate_tx_idx RENAME TO outbox_legacy_aggregate_tx_idx;
      ALTER INDEX outbox_slow_available_at_idx RENAME TO outbox_legacy_slow_available_at_idx;
      ALTER INDEX outbox_slow_aggregate_idx RENAME TO outbox_legacy_slow_aggregate_idx;
      ALTER TABLE outbox RENAME TO outbox_legacy;
      ALTER TABLE outbox_parted RENAME TO outbox;
      ALTER INDEX outbox_parted_tx_idx RENAME TO outbox_tx_idx;
      ALTER INDEX outbox_parted_aggregate_tx_idx RENAME TO outbox_aggregate_tx_idx;
      ALTER INDEX outbox_parted_slow_available_at_idx RENAME TO outbox_slow_available_at_idx;
      ALTER INDEX outbox_parted_slow_aggregate_idx RENAME TO outbox_slow_aggregate_idx;
      -- No scan: the validated outbox_legacy_part implies the bound.
      ALTER TABLE outbox ATTACH PARTITION outbox_legacy FOR VALUES IN (-1);
      ALTER TABLE outbox_legacy DROP CONSTRAINT outbox_legacy_part;
      ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;
      FOREACH pub IN ARRAY pubs LOOP
        EXECUTE format('ALTER PUBLICATION %I DROP TABLE outbox_legacy', pub);
        EXECUTE format('ALTER PUBLICATION %I ADD TABLE outbox', pub);
        EXECUTE format('ALTER PUBLICATION %I SET (publish_via_partition_root = true)', pub);
      END LOOP;
      RETURN;
    EXCEPTION WHEN lock_not_available THEN
      tries := tries + 1;
      IF tries >= 240 THEN
        RAISE EXCEPTION 'could not lock the outbox for 2 minutes (a long transaction holds a lock on it: see pg_locks); nothing was swapped, run migrate up again';
      END IF;
      PERFORM pg_sleep(0.5);
    END;
  END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Run with the relays stopped: every row goes back into one table.
-- +goose StatementBegin
DO $$
DECLARE
  pubs text[];
  pub text;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass) <> 'p' THEN
    RETURN;
  END IF;
  SELECT coalesce(array_agg(p.pubname), '{}') INTO pubs FROM pg_publication p
    JOIN pg_publication_rel r ON r.prpubid = p.oid WHERE r.prrelid = 'outbox'::regclass;
  IF to_regclass('outbox_legacy') IS NULL THEN
    CREATE TABLE outbox_legacy (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
  ELSE
    ALTER TABLE outbox DETACH PARTITION outbox_legacy;
  END IF;
  ALTER TABLE outbox_legacy DROP CONSTRAINT IF EXISTS outbox_legacy_part;
  INSERT INTO outbox_legacy SELECT * FROM outbox;
  ALTER SEQUENCE outbox_id_seq OWNED BY NONE;
  DROP TABLE outbox;
  ALTER TABLE outbox_legacy RENAME TO outbox;
  ALTER TABLE outbox DROP COLUMN part;
  IF EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'outbox_legacy_pkey' AND conrelid = 'outbox'::regclass) THEN
    ALTER TABLE outbox RENAME CONSTRAINT outbox_legacy_pkey TO outbox_pkey;
  ELSE
    ALTER TABLE outbox ADD CONSTRAINT outbox_pkey PRIMARY KEY (id);
  END IF;
  ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;
  ALTER TABLE outbox_archive DROP COLUMN IF EXISTS part;
  DROP INDEX IF EXISTS outbox_legacy_tx_idx, outbox_legacy_aggregate_tx_idx,
    outbox_legacy_slow_available_at_idx, outbox_legacy_slow_aggregate_idx;
  CREATE INDEX outbox_tx_idx ON outbox (tx, id);
  CREATE INDEX outbox_aggregate_tx_idx ON outbox (aggregate_id, tx);
  CREATE INDEX outbox_slow_available_at_idx ON outbox (available_at)
    WHERE dispatched_at IS NULL AND (slow OR tx IS NULL);
  CREATE INDEX outbox_slow_aggregate_idx ON outbox (aggregate_id, id)
    WHERE dispatched_at IS NULL AND (slow OR tx IS NULL);
  FOREACH pub IN ARRAY pubs LOOP
    EXECUTE format('ALTER PUBLICATION %I ADD TABLE outbox', pub);
    EXECUTE format('ALTER PUBLICATION %I SET (publish_via_partition_root = false)', pub);
  END LOOP;
  DROP FUNCTION ferry_outbox_part(timestamptz);
END
$$;
-- +goose StatementEnd
