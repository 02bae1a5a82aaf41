-- +goose Up
-- The transactional outbox. Rows are written in the same transaction as the
-- business change that caused them and relayed to the broker afterwards.
CREATE TABLE outbox (
    id            bigserial   PRIMARY KEY,
    aggregate_id  text        NOT NULL,
    topic         text        NOT NULL,
    payload       jsonb       NOT NULL,
    -- trace_id / correlation_id, schema_version, tenant_id, ...: travel with the message.
    headers       jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- Not relayed before this instant: delayed delivery and relay backoff share it.
    available_at  timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz NULL,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text        NULL
);

-- Partial indexes: they hold only pending rows, so a claim stays an index
-- range scan however many dispatched rows the table keeps.
CREATE INDEX outbox_pending_available_at_idx ON outbox (available_at) WHERE dispatched_at IS NULL;
CREATE INDEX outbox_pending_aggregate_idx ON outbox (aggregate_id, id) WHERE dispatched_at IS NULL;

-- +goose Down
DROP TABLE outbox;
