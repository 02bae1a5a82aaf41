-- +goose Up
-- Wake the relays when events commit. NOTIFY is transactional: it is
-- delivered on commit and never for a rolled-back insert, so a relay
-- listening on ferry_outbox wakes exactly when there is new work. One
-- notification per statement (and PostgreSQL folds duplicates within a
-- transaction), so a bulk insert costs one. The payload is the schema, so
-- relays of other schemas in the same database can ignore it. Polling stays
-- as the fallback: a lost notification costs one poll interval.
-- +goose StatementBegin
CREATE FUNCTION ferry_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ferry_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION ferry_outbox_notify();

-- +goose Down
DROP TRIGGER outbox_notify ON outbox;
DROP FUNCTION ferry_outbox_notify();
