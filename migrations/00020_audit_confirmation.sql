-- +goose Up
-- A console confirmation is single-use: the action it confirms records its
-- nonce in the audit entry written in the action's own transaction, and a
-- second use of the same confirmation (the form posted again, a browser
-- re-sending the POST) meets this index and rolls its action back.
CREATE UNIQUE INDEX ferry_audit_log_confirmation ON ferry_audit_log ((detail->>'confirmation'))
  WHERE detail ? 'confirmation';

-- +goose Down
DROP INDEX ferry_audit_log_confirmation;
