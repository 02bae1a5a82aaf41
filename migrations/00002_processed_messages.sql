-- +goose Up
-- The consumers' idempotency ledger: one row per (consumer, message) whose
-- effect has run. It is inserted in the handler's own transaction, so the
-- primary key is what stops two deliveries of one message running the effect twice.
CREATE TABLE processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention prunes by age.
CREATE INDEX processed_messages_processed_at_idx ON processed_messages (processed_at);

-- +goose Down
DROP TABLE processed_messages;
