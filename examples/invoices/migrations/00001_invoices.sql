-- +goose Up
CREATE TABLE invoices (
    id           bigserial   PRIMARY KEY,
    tenant_id    text        NOT NULL,
    customer     text        NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    issued_at    timestamptz NOT NULL DEFAULT now(),
    sent_at      timestamptz NULL
);

-- +goose Down
DROP TABLE invoices;
