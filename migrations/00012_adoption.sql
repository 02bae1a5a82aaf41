-- +goose Up
-- Adopting Ferry in a service that already runs (packages cutoff, shadow,
-- backfill).
--
-- Shadow mode: the legacy code keeps performing the effect and records it
-- here (shadow.RecordLegacy); the new code writes the intent marked shadow,
-- which the relay marks dispatched without publishing (outbox.shadowed), so
-- `ferry shadow report` can compare the two sides per topic and aggregate.
CREATE TABLE ferry_legacy_effects (
    id           bigserial   PRIMARY KEY,
    topic        text        NOT NULL,
    aggregate_id text        NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ferry_legacy_effects_topic_idx ON ferry_legacy_effects (topic, recorded_at);
ALTER TABLE outbox ADD COLUMN shadowed boolean NOT NULL DEFAULT false;
-- The archive is filled with SELECT * from the outbox: same columns, same order.
ALTER TABLE outbox_archive ADD COLUMN shadowed boolean NOT NULL DEFAULT false;

-- Backfill: one row per (backfill name, topic, aggregate) whose intent was
-- written, in the same transaction as the intent, so a re-run or a resumed
-- run writes no intent twice.
CREATE TABLE ferry_backfill_items (
    name         text        NOT NULL,
    topic        text        NOT NULL,
    aggregate_id text        NOT NULL,
    message_uuid text        NOT NULL,
    available_at timestamptz NOT NULL,
    written_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, topic, aggregate_id)
);

-- +goose Down
DROP TABLE ferry_backfill_items;
ALTER TABLE outbox_archive DROP COLUMN shadowed;
ALTER TABLE outbox DROP COLUMN shadowed;
DROP TABLE ferry_legacy_effects;
