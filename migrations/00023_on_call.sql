-- +goose Up
-- What an operator at 3 a.m. needs on top of the console's reads.
--
-- A discard is undoable: the poison store's discarded messages move here,
-- with who discarded them and the run (one confirmed action) they went
-- with, so `ferry poison undo --run` and the console's Undo put a whole
-- run back. Retention removes them after FERRY_POISON_ARCHIVE_RETENTION.
CREATE TABLE ferry_poison_archive (
    id              bigint      PRIMARY KEY,  -- the poison id it had (and gets back)
    message_id      text        NOT NULL,
    topic           text        NOT NULL,
    handler         text        NOT NULL,
    consumer        text        NOT NULL,
    aggregate_id    text        NOT NULL,
    payload         bytea       NOT NULL,
    headers         jsonb       NOT NULL,
    reason          text        NOT NULL,
    permanent       boolean     NOT NULL,
    attempts        integer     NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at  timestamptz NOT NULL,
    poisoned_at     timestamptz NOT NULL,
    correlation_id  text        NOT NULL,
    discarded_at    timestamptz NOT NULL DEFAULT now(),
    discarded_by    text        NOT NULL,
    discard_run     text        NOT NULL
);
CREATE INDEX ferry_poison_archive_run_idx ON ferry_poison_archive (discard_run);
CREATE INDEX ferry_poison_archive_discarded_at_idx ON ferry_poison_archive (discarded_at);

-- "Where is this message?" looks the poison store up by message,
-- aggregate and correlation id; it is small, so three indexes cost little.
CREATE INDEX poison_messages_message_id_idx ON poison_messages (message_id);
CREATE INDEX poison_messages_aggregate_id_idx ON poison_messages (aggregate_id) WHERE aggregate_id <> '';
CREATE INDEX poison_messages_correlation_id_idx ON poison_messages (correlation_id) WHERE correlation_id <> '';

-- A held head's own page: its payload and headers (kept once, at its
-- first failure), and "retry now", which the holding consumer picks up
-- within a second instead of sleeping out its backoff.
ALTER TABLE ferry_held_partitions
    ADD COLUMN payload            bytea       NULL,
    ADD COLUMN headers            jsonb       NULL,
    ADD COLUMN retry_requested_at timestamptz NULL;

-- Handlers paused by an operator: their consumers wait before handling
-- (deliveries stay unacked, in order) until the row goes.
CREATE TABLE ferry_handler_pauses (
    handler   text        PRIMARY KEY,  -- the route's name
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text        NOT NULL,
    reason    text        NOT NULL DEFAULT ''
);

-- Console actions too large for one request run in the background: the
-- job's progress, and its result once done, are here for its page.
CREATE TABLE ferry_jobs (
    id          bigserial   PRIMARY KEY,
    action      text        NOT NULL,
    scope       text        NOT NULL,
    actor       text        NOT NULL,
    total       integer     NOT NULL,
    done        integer     NOT NULL DEFAULT 0,
    skipped     integer     NOT NULL DEFAULT 0,
    state       text        NOT NULL DEFAULT 'running',  -- running, done, failed
    result      text        NOT NULL DEFAULT '',
    run         text        NOT NULL DEFAULT '',      -- the action's run (a discard's undo)
    confirmation text       NULL UNIQUE,              -- a confirmation starts one job, once
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz NULL
);

-- +goose Down
DROP TABLE ferry_jobs;
DROP TABLE ferry_handler_pauses;
ALTER TABLE ferry_held_partitions
    DROP COLUMN payload,
    DROP COLUMN headers,
    DROP COLUMN retry_requested_at;
DROP INDEX poison_messages_correlation_id_idx;
DROP INDEX poison_messages_aggregate_id_idx;
DROP INDEX poison_messages_message_id_idx;
DROP TABLE ferry_poison_archive;
