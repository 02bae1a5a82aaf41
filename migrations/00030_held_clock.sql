-- +goose Up
-- A hold's clock runs across its heads: a head poisoned and the next one
-- failing at once is one outage, so a released hold is kept (released_at)
-- and a new hold of the same partition within two minutes goes on with
-- its since. retry_at is when the holding consumer tries the head next:
-- a consumer that takes the head over after a restart waits for it
-- instead of spending an attempt at once.
ALTER TABLE ferry_held_partitions ADD COLUMN released_at timestamptz;
ALTER TABLE ferry_held_partitions ADD COLUMN retry_at timestamptz;

-- +goose Down
ALTER TABLE ferry_held_partitions DROP COLUMN retry_at;
ALTER TABLE ferry_held_partitions DROP COLUMN released_at;
