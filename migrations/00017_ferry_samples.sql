-- +goose Up
-- The console's charts of the last hour (outbox depth, dispatch rate and
-- latency, handler throughput and failures). Each relay and consumer
-- process appends its cumulative counters here with its heartbeat, every
-- 15 seconds: rates come from the differences, across processes and
-- across restarts of the console. A few hundred small rows an hour per
-- process, against a count over dispatched outbox rows (which have no
-- index on dispatched_at, on purpose: it would slow every dispatch).
-- Rows older than two hours are removed by the heartbeats themselves.
CREATE TABLE ferry_samples (
    instance_id text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    counters    jsonb       NOT NULL,
    PRIMARY KEY (instance_id, at)
);
CREATE INDEX ferry_samples_at_idx ON ferry_samples (at);

-- +goose Down
DROP TABLE ferry_samples;
