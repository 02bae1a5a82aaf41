-- +goose Up
-- The audit log names who acted and, in a field of its own, from where:
-- the identity (an authenticating proxy's header) and the client address
-- were one free-text actor ("oncall@corp.example 10.9.9.9:1"), so a
-- header could forge an address. A console session records when it was
-- last used: an idle session ends (FERRY_CONSOLE_IDLE_TIMEOUT).
ALTER TABLE ferry_audit_log ADD COLUMN address text NOT NULL DEFAULT '';
ALTER TABLE ferry_console_sessions ADD COLUMN last_seen_at timestamptz NOT NULL DEFAULT now();

-- +goose Down
ALTER TABLE ferry_console_sessions DROP COLUMN last_seen_at;
ALTER TABLE ferry_audit_log DROP COLUMN address;
