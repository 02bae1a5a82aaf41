-- +goose Up
-- Agent tool calls (package tools): one row per (tool, idempotency key),
-- written in the same transaction as the tool's business rows and intents.
-- The key comes from the host, never from the model; the same key with the
-- same arguments (args_sha256 of their canonical JSON) answers the stored
-- result as a replay, with other arguments it is refused. result is NULL
-- only inside the transaction that runs the tool.
CREATE TABLE ferry_tool_calls (
    tool            text        NOT NULL,
    idempotency_key text        NOT NULL,
    args_sha256     bytea       NOT NULL,
    result          text        NULL,   -- the result JSON, byte for byte: a replay answers exactly the same
    intent_ids      text[]      NOT NULL DEFAULT '{}',  -- message ids of the intents it wrote
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tool, idempotency_key)
);
-- Retention prunes by age.
CREATE INDEX ferry_tool_calls_created_at_idx ON ferry_tool_calls (created_at);

-- +goose Down
DROP TABLE ferry_tool_calls;
