-- +goose Up
-- Liveness of Ferry's processes for `ferry status`: each relay and consumer
-- process upserts its row every few seconds and deletes it on a clean stop.
-- A row whose heartbeat is old is a process that died.
CREATE TABLE ferry_instances (
    instance_id  text        PRIMARY KEY,
    components   text        NOT NULL,  -- "relay,consumers,http,pruner"
    hostname     text        NOT NULL,
    pid          integer     NOT NULL,
    version      text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE ferry_instances;
