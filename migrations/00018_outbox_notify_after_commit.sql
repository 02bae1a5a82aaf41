-- +goose Up
-- The wake-up trigger of 00004 goes: a NOTIFY inside the producing
-- transaction makes PostgreSQL take an instance-wide lock at its commit,
-- so every producing transaction of the database committed one at a time
-- (32 writers: half the commit rate). Ferry's producers now send the
-- wake-up after their commit, from a connection of their own
-- (pgoutbox.Waker); the relays LISTEN as before and poll as the fallback.
-- Writers outside Ferry's code are found by that poll
-- (FERRY_RELAY_POLL_INTERVAL), or can send `SELECT pg_notify('ferry_outbox',
-- current_schema())` after their commit (docs/performance.md).
DROP TRIGGER outbox_notify ON outbox;
DROP FUNCTION ferry_outbox_notify();

-- +goose Down
-- +goose StatementBegin
CREATE FUNCTION ferry_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ferry_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION ferry_outbox_notify();
