-- +goose Up
-- Reserved. Until v0.3 this migration created the example's orders table in
-- the user's schema; the library now creates only library tables, and the
-- orders example brings its own migrations (examples/orders). Databases
-- migrated before keep their orders table, which the example's migration
-- adopts (CREATE TABLE IF NOT EXISTS). Kept as a no-op so the version
-- history of existing databases stays valid.
SELECT 1;

-- +goose Down
SELECT 1;
