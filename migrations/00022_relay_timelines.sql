-- +goose Up
-- The timeline of the server each outbox table was last relayed on. A relay
-- that finds the server on a newer timeline (a standby promoted: a failover)
-- makes the events dispatched just before it pending again, in the
-- transaction that records the new timeline (pgoutbox.Relay.CheckFailover):
-- with asynchronous replication the new primary can lack a consumer's last
-- ledger commits while it has the dispatches they followed.
CREATE TABLE ferry_relay_timelines (
  outbox_table  text        PRIMARY KEY,
  timeline      bigint      NOT NULL,
  recorded_at   timestamptz NOT NULL DEFAULT now(),
  replayed_at   timestamptz NULL,
  replayed_from bigint      NULL,
  replayed_rows bigint      NULL
);

-- +goose Down
DROP TABLE ferry_relay_timelines;
