-- +goose Up
-- Fingerprints keep SMTP reply codes: "550 5.1.1" (no such mailbox) and
-- "451 4.7.1" (try again later), "552" and "452", are not the same
-- failure. A reply code after the command it answers (RCPT TO: 550, MAIL
-- FROM:, DATA:, ending message:) stays, and so does the enhanced status
-- code after a reply code. The stored fingerprints are recomputed.
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
      '(?<![0-9.]|[Aa]nswered |[Ss]tatus |[Cc]ode |HTTP |Exception \(|SQLSTATE |[Rr]eply |TO: |FROM: |DATA: |[Mm]essage: |[245][0-9][0-9] )\d+(\.\d+)?', '<n>', 'g'),
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
      '"(?![a-z][a-z0-9_.-]{0,40}")[^"]*"', '"…"', 'g'),
      '\m[0-9a-fA-F]{12,}\M', '<hex>', 'g'),
      '(?<![0-9.]|[Aa]nswered |[Ss]tatus |[Cc]ode |HTTP |Exception \(|SQLSTATE |[Rr]eply )\d+(\.\d+)?', '<n>', 'g'),
      '\s+', ' ', 'g'),
    300)
$$;
-- +goose StatementEnd
UPDATE poison_messages SET reason = reason;
