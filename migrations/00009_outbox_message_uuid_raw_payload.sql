-- +goose Up
-- Ferry as a Watermill Pub/Sub: the publisher's message UUID travels end to
-- end (it is the consumers' idempotency key; the row id stays the row key),
-- and any payload bytes are delivered as they were published. payload_raw
-- keeps the exact bytes; payload keeps the jsonb copy that makes JSON
-- events queryable, and is NULL for payloads that are not JSON. Rows written
-- before this migration have neither new column: the relay sends their
-- jsonb text and their row id as the UUID, as it did before.
ALTER TABLE outbox
    ADD COLUMN message_uuid text NULL,
    ADD COLUMN payload_raw  bytea NULL,
    ALTER COLUMN payload DROP NOT NULL,
    ADD CONSTRAINT outbox_payload_present CHECK (payload IS NOT NULL OR payload_raw IS NOT NULL);
-- The archive is filled with SELECT * from the outbox: same columns, same order.
ALTER TABLE outbox_archive
    ADD COLUMN message_uuid text NULL,
    ADD COLUMN payload_raw  bytea NULL,
    ALTER COLUMN payload DROP NOT NULL;

-- +goose Down
DELETE FROM outbox WHERE payload IS NULL;
DELETE FROM outbox_archive WHERE payload IS NULL;
ALTER TABLE outbox_archive DROP COLUMN payload_raw, DROP COLUMN message_uuid, ALTER COLUMN payload SET NOT NULL;
ALTER TABLE outbox DROP CONSTRAINT outbox_payload_present, DROP COLUMN payload_raw, DROP COLUMN message_uuid, ALTER COLUMN payload SET NOT NULL;
