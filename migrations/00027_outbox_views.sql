-- +goose Up
-- Operator views: one per row state (pgoutbox/views.go). A row sent at its
-- first try keeps dispatched_at NULL (the relay's position passes it), so
-- "WHERE dispatched_at IS NULL" counts every row ever relayed as pending:
-- SELECT count(*) FROM ferry_outbox_pending gives what ferry status gives.
-- Generated from pgoutbox.Table.ViewsDDL: edit that, then run
-- go test ./pipeline/pgoutbox/ -run TestViewsMigrationIsTheViewsDDL -update
-- +goose StatementBegin
CREATE OR REPLACE VIEW "ferry_outbox_pending" AS SELECT * FROM (SELECT o.* FROM "outbox" o WHERE o.dispatched_at IS NULL AND (o.slow OR o.tx IS NULL)
		UNION ALL
		SELECT o.* FROM "outbox" o
		WHERE o.tx >= pg_snapshot_xmax(coalesce((SELECT rp.snap FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp), '1:1:'::pg_snapshot))
		  AND o.tx <= (SELECT max(m.tx) FROM "outbox" m)
		  AND o.dispatched_at IS NULL AND NOT o.slow
		  AND NOT coalesce(pg_visible_in_snapshot(o.tx, (SELECT rp.cur FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp))
		       AND (o.tx, o.id) <= ((SELECT rp.last_tx FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp), (SELECT rp.last_id FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp)), false)
		UNION ALL
		SELECT o.* FROM "outbox" o
		WHERE o.tx = ANY(ARRAY(SELECT pg_snapshot_xip(coalesce((SELECT rp.snap FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp), '1:1:'::pg_snapshot))))
		  AND o.dispatched_at IS NULL AND NOT o.slow
		  AND NOT coalesce(pg_visible_in_snapshot(o.tx, (SELECT rp.cur FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp))
		       AND (o.tx, o.id) <= ((SELECT rp.last_tx FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp), (SELECT rp.last_id FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp)), false)) p;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE VIEW "ferry_outbox_failing" AS SELECT * FROM "ferry_outbox_pending" p WHERE attempts > 0 AND last_error IS NOT NULL;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE VIEW "ferry_outbox_retrying" AS SELECT * FROM "ferry_outbox_pending" p WHERE topic = 'ferry.retry';
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE VIEW "ferry_outbox_dispatched" AS SELECT o.* FROM "outbox" o WHERE (o.dispatched_at IS NOT NULL OR (NOT o.slow AND o.tx IS NOT NULL AND EXISTS (SELECT 1 FROM (SELECT * FROM "ferry_relay_positions" WHERE outbox_table = 'outbox' ORDER BY seq DESC LIMIT 1) rp
		WHERE (pg_visible_in_snapshot(o.tx, rp.snap)
		     OR (rp.cur IS NOT NULL AND pg_visible_in_snapshot(o.tx, rp.cur) AND (o.tx, o.id) <= (rp.last_tx, rp.last_id))))));
-- +goose StatementEnd

-- +goose Down
DROP VIEW IF EXISTS "ferry_outbox_dispatched";
DROP VIEW IF EXISTS "ferry_outbox_retrying";
DROP VIEW IF EXISTS "ferry_outbox_failing";
DROP VIEW IF EXISTS "ferry_outbox_pending";
