-- +goose Up
-- The operator console (package console) and `ferry poison list --group`:
-- failures grouped by an error fingerprint, the reason with ids, numbers,
-- addresses and quoted values normalised away, so "order 12: 503 from
-- 10.0.0.7" and "order 99: 503 from 10.0.0.8" are one group. It is a
-- function of the reason alone (IMMUTABLE), so the poison store keeps it as
-- a generated, indexed column, and failing outbox rows use it on the fly.
-- +goose StatementBegin
CREATE FUNCTION ferry_fingerprint(reason text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT left(
    regexp_replace(
    regexp_replace(
    regexp_replace(
    regexp_replace(
    regexp_replace(
    regexp_replace(
    regexp_replace(
    regexp_replace(coalesce(reason, ''),
      '[[:cntrl:]\u200b-\u200f\u202a-\u202e\u2066-\u2069]', '?', 'g'),
      '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}', '<uuid>', 'g'),
      '[^\s<>@"'',;:()\[\]]+@[^\s<>@"'',;:()\[\]]+', '<email>', 'g'),
      '\m\d{1,3}(\.\d{1,3}){3}(:\d+)?\M', '<ip>', 'g'),
      '"[^"]*"', '"…"', 'g'),
      '\m[0-9a-fA-F]{12,}\M', '<hex>', 'g'),
      '\d+(\.\d+)?', '<n>', 'g'),
      '\s+', ' ', 'g'),
    300)
$$;
-- +goose StatementEnd
ALTER TABLE poison_messages ADD COLUMN fingerprint text GENERATED ALWAYS AS (ferry_fingerprint(reason)) STORED;
CREATE INDEX poison_messages_fingerprint_idx ON poison_messages (fingerprint, id);
CREATE INDEX poison_messages_handler_idx ON poison_messages (handler, id);

-- Every state-changing action an operator takes (console or CLI): who,
-- when, what, on how many.
CREATE TABLE ferry_audit_log (
    id     bigserial   PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    actor  text        NOT NULL,
    action text        NOT NULL,   -- poison.requeue, poison.discard
    scope  text        NOT NULL,   -- what was selected: ids, a group, a filter
    count  integer     NOT NULL,
    detail jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX ferry_audit_log_at_idx ON ferry_audit_log (at);

-- +goose Down
DROP TABLE ferry_audit_log;
DROP INDEX poison_messages_handler_idx;
DROP INDEX poison_messages_fingerprint_idx;
ALTER TABLE poison_messages DROP COLUMN fingerprint;
DROP FUNCTION ferry_fingerprint(text);
