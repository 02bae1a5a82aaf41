-- +goose Up
-- Ordered partitions whose head message keeps failing: the consumer holds
-- the partition (the later messages of its aggregates wait behind it) in
-- process, through its backoff. It records the hold here so that status,
-- the console and the metrics can say which partition waits, since when,
-- behind which message and why. The row goes when the head is handled,
-- poisoned or the consumer stops; a row whose consumer died is replaced by
-- the next consumer's hold, or removed an hour after its last update.
CREATE TABLE ferry_held_partitions (
    consumer    text        PRIMARY KEY,   -- the partition's router handler: payments.charge@3
    message_id  text        NOT NULL,
    since       timestamptz NOT NULL,
    attempt     integer     NOT NULL,
    last_error  text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE ferry_held_partitions;
