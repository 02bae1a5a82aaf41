-- +goose Up
-- Fingerprints keep what tells failures apart: a short code-like quoted
-- value ("stolen_card" and "insufficient_funds" are two groups, not one
-- "…"), a status or reply code after the words that introduce one
-- (answered 402, status 503, code 42, HTTP 429, Exception (403), SQLSTATE
-- 23505), while ids, counts, addresses and free text are still normalised.
-- The stored fingerprints are recomputed (a generated column is computed
-- again when its row is updated).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION ferry_fingerprint(reason text) RETURNS text
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
      '"(?![a-z][a-z0-9_.-]{0,40}")[^"]*"', '"…"', 'g'),
      '\m[0-9a-fA-F]{12,}\M', '<hex>', 'g'),
      '(?<![0-9.]|[Aa]nswered |[Ss]tatus |[Cc]ode |HTTP |Exception \(|SQLSTATE |[Rr]eply )\d+(\.\d+)?', '<n>', 'g'),
      '\s+', ' ', 'g'),
    300)
$$;
-- +goose StatementEnd
UPDATE poison_messages SET reason = reason;

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION ferry_fingerprint(reason text) RETURNS text
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
UPDATE poison_messages SET reason = reason;
