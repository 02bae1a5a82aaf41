-- +goose Up
-- The tenant registry (pgtenants): each tenant's outbox, in a database
-- and schema of its own, served by one fleet of Ferry processes
-- (FERRY_TENANTS=on). It lives in the fleet's own database, the control
-- database, beside the poison store and the audit log every tenant shares,
-- so that a tenant is added, paused or removed with one transaction that
-- every process of the fleet sees at its next reload, without a restart
-- and without a file to copy to each host.
--
-- database_url may name environment variables as ${NAME} (a password
-- from the process's secrets instead of the table); '' is the control
-- database itself (a tenant per schema).
CREATE TABLE ferry_tenants (
    tenant_id    text             PRIMARY KEY CHECK (tenant_id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    database_url text             NOT NULL DEFAULT '',
    schema_name  text             NOT NULL DEFAULT '',
    paused       boolean          NOT NULL DEFAULT false,
    paused_by    text             NOT NULL DEFAULT '',
    reason       text             NOT NULL DEFAULT '',
    -- events/s the fleet relays for this tenant; 0: no limit of its own
    relay_rate   double precision NOT NULL DEFAULT 0 CHECK (relay_rate >= 0),
    -- handlers of one process running this tenant's messages at once; 0: no limit of its own
    max_handlers integer          NOT NULL DEFAULT 0 CHECK (max_handlers >= 0),
    added_at     timestamptz      NOT NULL DEFAULT now(),
    updated_at   timestamptz      NOT NULL DEFAULT now(),
    -- Two tenants on one outbox would read each other's events.
    UNIQUE (database_url, schema_name)
);

-- One number every change of the registry raises, in its transaction: what
-- each process's reload reads first. (A count with the newest updated_at
-- can come back to a value a reload saw: a tenant added and removed, or a
-- change committed after a later one was read.)
CREATE TABLE ferry_tenants_version (
    one     boolean PRIMARY KEY DEFAULT true CHECK (one),
    version bigint  NOT NULL
);
INSERT INTO ferry_tenants_version VALUES (true, 0);

-- +goose Down
DROP TABLE ferry_tenants_version;
DROP TABLE ferry_tenants;
