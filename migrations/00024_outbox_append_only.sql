-- +goose NO TRANSACTION
-- +goose Up
-- Append-only dispatch. The relay no longer marks each dispatched row with
-- an UPDATE: while any long transaction is open (a report, pg_dump, a
-- standby's hot_standby_feedback) every such update left a dead tuple and
-- a dead entry in the pending index that each claim walked again, and the
-- relay slowed to a third of its rate within minutes.
--
-- Instead every row records the transaction that wrote it (tx), and the
-- relay keeps one position per outbox table: the snapshot up to which it
-- has passed every committed row (PgQ's batches by snapshot). A row behind
-- the position was dispatched unless it carries per-row state: rows that
-- failed, were delayed, or were held behind an earlier row of their
-- aggregate are marked slow and keep attempts, last_error, available_at
-- and dispatched_at as before. Rows written before this migration (tx
-- NULL) are relayed as before too.
--
-- Online: the columns are added under a short lock_timeout, retried, so
-- that a long transaction holding a lock on the outbox (pg_dump) makes
-- this migration wait, not every producer behind it; the indexes are
-- built CONCURRENTLY, without blocking producers or relays.

-- +goose StatementBegin
DO $$
DECLARE
  tries int := 0;
BEGIN
  LOOP
    BEGIN
      PERFORM set_config('lock_timeout', '500ms', true);
      ALTER TABLE outbox
        ADD COLUMN IF NOT EXISTS tx xid8 NULL,
        ADD COLUMN IF NOT EXISTS slow boolean NOT NULL DEFAULT false;
      -- Set in the same transaction as the column: every row committed
      -- after this migration carries its writer's transaction.
      ALTER TABLE outbox ALTER COLUMN tx SET DEFAULT pg_current_xact_id();
      -- The archive is filled with SELECT * from the outbox: same columns, same order.
      ALTER TABLE outbox_archive
        ADD COLUMN IF NOT EXISTS tx xid8 NULL,
        ADD COLUMN IF NOT EXISTS slow boolean NOT NULL DEFAULT false;
      -- Processes of this version say so in their heartbeat. While a relay
      -- of an earlier version is alive it would take a row the position
      -- passed for pending (its dispatched_at is not set) and send it
      -- again: the relays of this version then mark each row they send as
      -- well (pgstatus.EarlierRelaysAlive).
      ALTER TABLE ferry_instances ADD COLUMN IF NOT EXISTS relay_lanes boolean NOT NULL DEFAULT false;
      RETURN;
    EXCEPTION WHEN lock_not_available THEN
      tries := tries + 1;
      IF tries >= 240 THEN
        RAISE EXCEPTION 'could not lock the outbox for 2 minutes (a long transaction holds a lock on it: see pg_locks); nothing was changed, run migrate up again';
      END IF;
      PERFORM pg_sleep(0.5);
    END;
  END LOOP;
END
$$;
-- +goose StatementEnd

-- The relay's position per outbox table, its newest row (highest seq):
-- every row whose tx is visible in snap has been passed; cur, when set, is
-- the snapshot of the batch range being worked through, passed up to
-- (last_tx, last_id). No row means nothing has been passed yet. Each move
-- is a new row, never an update: a row updated by every batch would keep
-- every old version while a long transaction is open, and each read of it
-- would walk them all; the newest row is the first the primary key's
-- backward scan finds. The relay deletes rows far behind the newest.
CREATE TABLE IF NOT EXISTS ferry_relay_positions (
  outbox_table text        NOT NULL,
  seq          bigint      GENERATED ALWAYS AS IDENTITY,
  snap         pg_snapshot NOT NULL,
  cur          pg_snapshot NULL,
  last_tx      xid8        NULL,
  last_id      bigint      NULL,
  moved_at     timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (outbox_table, seq)
);

-- The batch range's rows in the order the relay passes them.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_tx_idx ON outbox (tx, id);
-- An aggregate's rows not yet passed: the head-of-aggregate rule.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_aggregate_tx_idx ON outbox (aggregate_id, tx);
-- Rows with per-row state, still pending: small, and updated only for them.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_slow_available_at_idx ON outbox (available_at)
  WHERE dispatched_at IS NULL AND (slow OR tx IS NULL);
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_slow_aggregate_idx ON outbox (aggregate_id, id)
  WHERE dispatched_at IS NULL AND (slow OR tx IS NULL);
-- Every new row would enter these and never leave them.
DROP INDEX CONCURRENTLY IF EXISTS outbox_pending_available_at_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_pending_aggregate_idx;

-- +goose Down
-- Run with the relays stopped. Rows the relay passed get the dispatched_at
-- the per-row design reads (their creation time: when they were passed is
-- not recorded), in one statement.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_pending_available_at_idx ON outbox (available_at) WHERE dispatched_at IS NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_pending_aggregate_idx ON outbox (aggregate_id, id) WHERE dispatched_at IS NULL;
-- +goose StatementBegin
DO $$
BEGIN
  UPDATE outbox o SET dispatched_at = o.created_at
  FROM (SELECT * FROM ferry_relay_positions WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) p
  WHERE o.dispatched_at IS NULL AND NOT o.slow AND o.tx IS NOT NULL
    AND (pg_visible_in_snapshot(o.tx, p.snap)
         OR (p.cur IS NOT NULL AND pg_visible_in_snapshot(o.tx, p.cur) AND (o.tx, o.id) <= (p.last_tx, p.last_id)));
  ALTER TABLE outbox ALTER COLUMN tx DROP DEFAULT;
  ALTER TABLE outbox DROP COLUMN tx, DROP COLUMN slow;
  ALTER TABLE outbox_archive DROP COLUMN tx, DROP COLUMN slow;
  ALTER TABLE ferry_instances DROP COLUMN relay_lanes;
  DROP TABLE ferry_relay_positions;
END
$$;
-- +goose StatementEnd
