-- +goose Up
-- Events parked out of an ordered partition while their tenant's database
-- is out of reach (tenancy.Parking, FERRY_TENANTS=on). An ordered
-- partition is every tenant's: holding it behind one tenant's event would
-- make every tenant wait out that tenant's outage. Instead the event, and
-- every later event of that tenant in that partition, waits here in order
-- (seq), the delivery is acked and the partition goes on with the other
-- tenants. Once the tenant's database answers, any process of the fleet
-- sends the parked events back into the partition's queue, in order; each
-- row goes when its event has been handled there. The table lives in the
-- control database so that a partition's next consumer (another process,
-- after a failover) finds what its previous one parked.
CREATE TABLE ferry_parked (
    seq        bigserial   PRIMARY KEY,
    consumer   text        NOT NULL,   -- the partition's router handler: payments.charge@3
    tenant_id  text        NOT NULL,
    message_id text        NOT NULL,
    payload    bytea       NOT NULL,
    headers    jsonb       NOT NULL,
    reason     text        NOT NULL DEFAULT '',
    parked_at  timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz,             -- sent back to the partition, not handled yet
    UNIQUE (consumer, tenant_id, message_id)
);
CREATE INDEX ferry_parked_group ON ferry_parked (consumer, tenant_id, seq);

-- +goose Down
DROP TABLE ferry_parked;
