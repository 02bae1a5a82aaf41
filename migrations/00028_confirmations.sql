-- +goose Up
-- What an operator was shown before an action: the exact ids a preview
-- counted, kept under the confirmation's single-use nonce until it
-- expires. The action then acts on those ids and nothing else (a row that
-- joined the selection after the preview is left alone, one that left it
-- is reported as gone), so "the exact set it was shown for" holds whatever
-- happened between the preview and the click (pipeline/pgconfirm).
CREATE TABLE ferry_confirmations (
    nonce      text        PRIMARY KEY,
    kind       text        NOT NULL,   -- poison, failing, retrying, ...
    action     text        NOT NULL,   -- requeue, discard, retry-now, ...
    selection  text        NOT NULL,   -- the canonical selection (pgfilter.Selection.Canonical)
    ids        bigint[]    NOT NULL,
    total      integer     NOT NULL,   -- how many the selection held, ids the oldest of them
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX ferry_confirmations_expires_at_idx ON ferry_confirmations (expires_at);

-- +goose Down
DROP TABLE ferry_confirmations;
