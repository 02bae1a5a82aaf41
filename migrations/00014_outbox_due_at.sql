-- +goose Up
-- When a row first became due: its available_at as written (now, or the
-- delay it asked for: a scheduled event, a durable retry's backoff), which
-- the relay's own backoff later moves. Dispatch latency is measured from
-- it, so that a delay that was asked for does not read as a slow relay.
-- NULL on rows written before: their creation time stands in.
ALTER TABLE outbox ADD COLUMN due_at timestamptz NULL;
-- The archive is filled with SELECT * from the outbox: same columns, same order.
ALTER TABLE outbox_archive ADD COLUMN due_at timestamptz NULL;

-- +goose Down
ALTER TABLE outbox_archive DROP COLUMN due_at;
ALTER TABLE outbox DROP COLUMN due_at;
