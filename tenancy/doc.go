// Package tenancy runs one Ferry fleet over many tenants' outboxes, each
// in a database and schema of its own, as the tenant registry
// (pgtenants) lists them: a relay Fleet that shares the tenants among its
// processes and takes them in turn, so that one tenant's backlog does not
// hold another's new events; and the consumers' Ledgers, which handle each
// event in its own tenant's database. The application wires them when
// FERRY_TENANTS is on (app.New); the manual is "Many tenant databases"
// (tenants.md) in the docs.
package tenancy
