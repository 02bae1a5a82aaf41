-- +goose NO TRANSACTION
-- +goose Up
-- The consumers' ledger, retained by whole partitions as the outbox is
-- (00025): pruning it with DELETE left a dead tuple per processed message,
-- the kind a long transaction keeps. processed_messages becomes a table
-- partitioned by part, the same ring of 16 weekly slots
-- (ferry_outbox_part(now()), pgweeks); a slot whose last week is past the
-- ledger's retention is emptied with TRUNCATE (pgledger.ClearPartitions).
--
-- A ledger row says a consumer ran a message's effect; its key is
-- (consumer, message_id), unique across every partition. A partition's
-- primary key guards one week only, so the trigger ferry_ledger_once
-- guards the others: an insert of a key another partition holds (a
-- redelivery in a later week) inserts nothing, as a conflict does, and the
-- consumer skips the effect. It runs for every writer of the table,
-- consumers of an earlier version during a rolling upgrade included.
--
-- Online: the table that holds today's rows is not copied. It becomes the
-- partition processed_messages_legacy (part = -1) in one short transaction
-- under a 500 ms lock_timeout, retried; validating the part constraint,
-- the slow part, is done beforehand without blocking consumers.

-- The weeks that may still hold ledger rows, so that an insert looks
-- only there: oldest_week is the oldest week (weeks since the epoch's
-- first Monday) a partition may hold rows of; legacy_empty says the
-- legacy partition was found empty (it takes no new row). The pruner
-- (pgledger.ClearPartitions) sets both after it has cleared; an insert
-- into an older week widens it. Now the new partitions are empty: from
-- this week on, and the legacy partition.
CREATE TABLE ferry_ledger_ring (
    singleton    bool   PRIMARY KEY DEFAULT true CHECK (singleton),
    oldest_week  bigint NOT NULL,
    legacy_empty bool   NOT NULL DEFAULT false
);
INSERT INTO ferry_ledger_ring (oldest_week)
  VALUES (floor((extract(epoch FROM now()) + 259200) / 604800)::bigint);

-- +goose StatementBegin
-- ferry_outbox_part (00025), written so that the planner inlines it into
-- a column's default: extract(epoch) of a timestamptz is only STABLE, so
-- the IMMUTABLE function that called it ran as a function call for every
-- inserted row (a quarter of a ledger insert's time). The epoch of the
-- difference of two timestamptz is the same number, and IMMUTABLE.
CREATE OR REPLACE FUNCTION ferry_outbox_part(t timestamptz) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  -- Weeks since the epoch's first Monday, modulo 16 (pgweeks.Of).
  SELECT (floor((extract(epoch FROM t - timestamptz '1970-01-01 00:00:00+00') + 259200) / 604800)::bigint % 16)::smallint
$$;
-- +goose StatementEnd

-- +goose StatementBegin
-- The function names each partition (the ring's 16 and the legacy one),
-- each probe a statement of its own, run only for an earlier week that may
-- hold rows: a probe through the partitioned table (an Append over 17
-- index scans, set up for every row) halved a consumer's inserts per
-- second. The week's own partition is not probed: its primary key
-- conflicts. Which weeks may hold rows is read from ferry_ledger_ring at
-- most once a minute per session (kept in the setting ferry.ledger_ring):
-- the pruner only narrows it, so a session that has not seen that yet
-- probes a week more than it needs. SET search_path: the tables are those
-- beside the function, whatever the session's search path.
DO $$
DECLARE
  probes text := '';
BEGIN
  FOR i IN 0..15 LOOP
    probes := probes || format($p$
    IF (cur_part - %s + 16) %% 16 BETWEEN 1 AND back THEN
      IF EXISTS (SELECT 1 FROM %I p WHERE p.consumer = NEW.consumer AND p.message_id = NEW.message_id) THEN
        RETURN NULL;
      END IF;
    END IF;$p$, i, 'processed_messages_p' || lpad(i::text, 2, '0'));
  END LOOP;
  EXECUTE format($fn$
CREATE OR REPLACE FUNCTION ferry_ledger_once() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $body$
DECLARE
  -- Few expressions, each costs: this runs for every ledger row.
  now_s float8 := date_part('epoch', now());
  cur_week bigint := floor((now_s + 259200) / 604800);
  cur_part int := cur_week %% 16;
  -- The session's copy of the ring: {schema, expires, oldest_week, legacy_empty}.
  cache text[] := string_to_array(current_setting('ferry.ledger_ring', true), '|');
  row_week bigint;
  oldest bigint;
  legacy_empty bool;
  back int;
BEGIN
  -- Two deliveries of one message in two transactions: the later waits
  -- here for the earlier to end. Then, in READ COMMITTED, the probes
  -- below run with a snapshot taken after that wait and see the earlier's
  -- row if it committed. (Within one partition the primary key alone
  -- would do; across the week's turn only this lock does.)
  IF NOT pg_try_advisory_xact_lock(hashtext('processed_messages'), hashtext(NEW.consumer || chr(31) || NEW.message_id)) THEN
    PERFORM pg_advisory_xact_lock(hashtext('processed_messages'), hashtext(NEW.consumer || chr(31) || NEW.message_id));
    -- A snapshot older than the wait (REPEATABLE READ, SERIALIZABLE)
    -- cannot see the earlier delivery's row: fail as a serialization
    -- conflict does, and the delivery is tried again.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
      RAISE EXCEPTION 'message %% of consumer %% is being processed by another transaction', NEW.message_id, NEW.consumer
        USING ERRCODE = 'serialization_failure';
    END IF;
  END IF;
  IF cache[1] IS DISTINCT FROM TG_TABLE_SCHEMA OR cache[2]::float8 < now_s THEN
    SELECT r.oldest_week, r.legacy_empty INTO oldest, legacy_empty FROM ferry_ledger_ring r;
    IF NOT FOUND THEN
      oldest := cur_week - 15;
      legacy_empty := false;
    END IF;
    cache := NULL;
  ELSE
    oldest := cache[3];
    legacy_empty := cache[4];
  END IF;
  -- A row for an earlier week or for the legacy partition (a restore, a
  -- test) widens what is probed.
  IF NEW.part <> cur_part THEN
    IF NEW.part >= 0 THEN
      row_week := cur_week - (cur_part - NEW.part + 16) %% 16;
      IF row_week < oldest THEN
        UPDATE ferry_ledger_ring SET oldest_week = LEAST(oldest_week, row_week);
        oldest := row_week;
        cache := NULL;
      END IF;
    ELSIF legacy_empty THEN
      UPDATE ferry_ledger_ring SET legacy_empty = false;
      legacy_empty := false;
      cache := NULL;
    END IF;
  END IF;
  IF cache IS NULL THEN
    PERFORM set_config('ferry.ledger_ring', TG_TABLE_SCHEMA || '|' || (now_s + 60) || '|' || oldest || '|' || legacy_empty, false);
  END IF;
  -- Processed before, in an earlier week that may still hold it: nothing
  -- inserted, as on conflict.
  IF NOT legacy_empty THEN
    IF EXISTS (SELECT 1 FROM processed_messages_legacy p WHERE p.consumer = NEW.consumer AND p.message_id = NEW.message_id) THEN
      RETURN NULL;
    END IF;
  END IF;
  back := LEAST(15, cur_week - oldest);
  IF back > 0 THEN%s
  END IF;
  RETURN NEW;
END
$body$
$fn$, probes);
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
  tries int := 0;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'processed_messages'::regclass) = 'p' THEN
    RETURN; -- converted already
  END IF;
  LOOP
    BEGIN
      PERFORM set_config('lock_timeout', '500ms', true);
      -- A constant default: no rewrite, a catalog change.
      ALTER TABLE processed_messages ADD COLUMN IF NOT EXISTS part smallint NOT NULL DEFAULT -1;
      IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'processed_messages_legacy_part' AND conrelid = 'processed_messages'::regclass) THEN
        ALTER TABLE processed_messages ADD CONSTRAINT processed_messages_legacy_part CHECK (part = -1) NOT VALID;
      END IF;
      EXIT;
    EXCEPTION WHEN lock_not_available THEN
      tries := tries + 1;
      IF tries >= 240 THEN
        RAISE EXCEPTION 'could not lock processed_messages for 2 minutes (a long transaction holds a lock on it: see pg_locks); run migrate up again';
      END IF;
      PERFORM pg_sleep(0.5);
    END;
  END LOOP;
  -- A scan under a lock that lets consumers work: it spares the attach
  -- below a scan under an exclusive lock.
  ALTER TABLE processed_messages VALIDATE CONSTRAINT processed_messages_legacy_part;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
  i int;
  p text;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'processed_messages'::regclass) = 'p' THEN
    RETURN;
  END IF;
  DROP TABLE IF EXISTS processed_messages_parted;
  CREATE TABLE processed_messages_parted (LIKE processed_messages INCLUDING DEFAULTS) PARTITION BY LIST (part);
  ALTER TABLE processed_messages_parted ALTER COLUMN part SET DEFAULT ferry_outbox_part(now());
  -- Each partition's key is its own (a key of the partitioned table would
  -- have to hold part, and would guard nothing more). No processed_at
  -- index: retention empties whole weeks, and a consumer's insert writes
  -- one index less than before.
  FOR i IN 0..15 LOOP
    p := 'processed_messages_p' || lpad(i::text, 2, '0');
    EXECUTE format('CREATE TABLE %I PARTITION OF processed_messages_parted FOR VALUES IN (%s)', p, i);
    EXECUTE format('ALTER TABLE %I ADD PRIMARY KEY (consumer, message_id)', p);
  END LOOP;
  CREATE TRIGGER ferry_ledger_once BEFORE INSERT ON processed_messages_parted
    FOR EACH ROW EXECUTE FUNCTION ferry_ledger_once();
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $$
DECLARE
  tries int := 0;
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'processed_messages'::regclass) = 'p' THEN
    RETURN;
  END IF;
  LOOP
    BEGIN
      PERFORM set_config('lock_timeout', '500ms', true);
      LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE;
      ALTER TABLE processed_messages RENAME CONSTRAINT processed_messages_pkey TO processed_messages_legacy_pkey;
      ALTER INDEX processed_messages_processed_at_idx RENAME TO processed_messages_legacy_processed_at_idx;
      ALTER TABLE processed_messages RENAME TO processed_messages_legacy;
      ALTER TABLE processed_messages_parted RENAME TO processed_messages;
      -- No scan: the validated processed_messages_legacy_part implies the
      -- bound. The trigger is cloned onto it.
      ALTER TABLE processed_messages ATTACH PARTITION processed_messages_legacy FOR VALUES IN (-1);
      ALTER TABLE processed_messages_legacy DROP CONSTRAINT processed_messages_legacy_part;
      -- Exact under this lock: from now on rows go to the ring's weeks.
      UPDATE ferry_ledger_ring SET legacy_empty = NOT EXISTS (SELECT 1 FROM processed_messages_legacy);
      RETURN;
    EXCEPTION WHEN lock_not_available THEN
      tries := tries + 1;
      IF tries >= 240 THEN
        RAISE EXCEPTION 'could not lock processed_messages for 2 minutes (a long transaction holds a lock on it: see pg_locks); nothing was swapped, run migrate up again';
      END IF;
      PERFORM pg_sleep(0.5);
    END;
  END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Every row goes back into one table (one row per key: the trigger kept it so).
-- +goose StatementBegin
DO $$
BEGIN
  IF (SELECT relkind FROM pg_class WHERE oid = 'processed_messages'::regclass) <> 'p' THEN
    RETURN;
  END IF;
  IF to_regclass('processed_messages_legacy') IS NULL THEN
    CREATE TABLE processed_messages_legacy (LIKE processed_messages INCLUDING DEFAULTS);
  ELSE
    ALTER TABLE processed_messages DETACH PARTITION processed_messages_legacy;
    DROP TRIGGER IF EXISTS ferry_ledger_once ON processed_messages_legacy;
  END IF;
  INSERT INTO processed_messages_legacy SELECT * FROM processed_messages ON CONFLICT DO NOTHING;
  DROP TABLE processed_messages;
  ALTER TABLE processed_messages_legacy RENAME TO processed_messages;
  ALTER TABLE processed_messages DROP COLUMN part;
  IF EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'processed_messages_legacy_pkey' AND conrelid = 'processed_messages'::regclass) THEN
    ALTER TABLE processed_messages RENAME CONSTRAINT processed_messages_legacy_pkey TO processed_messages_pkey;
  ELSE
    ALTER TABLE processed_messages ADD CONSTRAINT processed_messages_pkey PRIMARY KEY (consumer, message_id);
  END IF;
  IF to_regclass('processed_messages_legacy_processed_at_idx') IS NOT NULL THEN
    ALTER INDEX processed_messages_legacy_processed_at_idx RENAME TO processed_messages_processed_at_idx;
  ELSE
    CREATE INDEX processed_messages_processed_at_idx ON processed_messages (processed_at);
  END IF;
  DROP FUNCTION ferry_ledger_once();
  DROP TABLE ferry_ledger_ring;
END
$$;
-- +goose StatementEnd
