-- +goose Up
-- The orders example's table. IF NOT EXISTS: databases migrated by Ferry
-- before v0.3 got this table from Ferry's own migration 00003, and keep it.
CREATE TABLE IF NOT EXISTS orders (
    id              bigserial   PRIMARY KEY,
    user_id         text        NOT NULL,
    amount          bigint      NOT NULL CHECK (amount > 0),
    currency        text        NOT NULL CHECK (currency IN ('JPY', 'USD')),
    idempotency_key text        NOT NULL UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE orders;
