-- +goose Up
-- The poison store: messages a consumer gave up on, with why and since
-- when. It is a table rather than a broker queue so that operators can list,
-- filter, requeue and discard with SQL's guarantees: a requeue writes the
-- message back into the outbox and removes it from here in one transaction,
-- so an interrupted requeue loses nothing and sends nothing twice.
CREATE TABLE poison_messages (
    id              bigserial   PRIMARY KEY,
    message_id      text        NOT NULL,   -- the original message id (ledger and idempotency key)
    topic           text        NOT NULL,   -- the original topic
    handler         text        NOT NULL,   -- the route that gave up
    consumer        text        NOT NULL DEFAULT '',  -- the router handler (partition/worker)
    aggregate_id    text        NOT NULL DEFAULT '',
    payload         bytea       NOT NULL,   -- as received: it may not even be JSON
    headers         jsonb       NOT NULL DEFAULT '{}',
    reason          text        NOT NULL,
    permanent       boolean     NOT NULL DEFAULT false, -- refused outright, not retried
    attempts        integer     NOT NULL DEFAULT 1,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    poisoned_at     timestamptz NOT NULL DEFAULT now(),
    correlation_id  text        NOT NULL DEFAULT ''
);
CREATE INDEX poison_messages_topic_idx ON poison_messages (topic, id);
CREATE INDEX poison_messages_poisoned_at_idx ON poison_messages (poisoned_at);

-- +goose Down
DROP TABLE poison_messages;
