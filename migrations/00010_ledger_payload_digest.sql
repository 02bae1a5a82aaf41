-- +goose Up
-- The ledger remembers what it processed, not only under which id: a
-- delivery that reuses a processed message id with other content (a forged
-- or buggy publisher) is told apart from a redelivery and poisoned with
-- the reason instead of being dropped as a duplicate. Rows written before
-- this migration have no digest and are taken as matching.
ALTER TABLE processed_messages ADD COLUMN payload_sha256 bytea NULL;

-- +goose Down
ALTER TABLE processed_messages DROP COLUMN payload_sha256;
