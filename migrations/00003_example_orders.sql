-- +goose Up
-- The example domain's table (package orders). An application of your own
-- keeps its tables in its own migrations; this one exists for `ferry demo`.
CREATE TABLE orders (
    id              bigserial   PRIMARY KEY,
    user_id         text        NOT NULL,
    amount          bigint      NOT NULL CHECK (amount > 0),
    currency        text        NOT NULL CHECK (currency IN ('JPY', 'USD')),
    idempotency_key text        NOT NULL UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE orders;
