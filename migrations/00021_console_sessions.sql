-- +goose Up
-- Console sessions live on the server: logging out ends one (an old cookie
-- no longer works), each has its own form and confirmation tokens, and
-- each names who logged in (the identity an authenticating proxy gives).
CREATE TABLE ferry_console_sessions (
  id         text PRIMARY KEY,
  identity   text NOT NULL DEFAULT '',
  created_at timestamptz NOT NULL DEFAULT now(),
  expires_at timestamptz NOT NULL
);
CREATE INDEX ferry_console_sessions_expires ON ferry_console_sessions (expires_at);

-- +goose Down
DROP TABLE ferry_console_sessions;
