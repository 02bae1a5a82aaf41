-- +goose Up
-- Where `ferry prune outbox --archive` moves dispatched rows instead of
-- deleting them: same columns, no partial indexes (nothing here is pending).
CREATE TABLE outbox_archive (LIKE outbox INCLUDING DEFAULTS);
ALTER TABLE outbox_archive ADD PRIMARY KEY (id);
CREATE INDEX outbox_archive_dispatched_at_idx ON outbox_archive (dispatched_at);

-- +goose Down
DROP TABLE outbox_archive;
