// Package ferry is a transactional-outbox event pipeline built on Watermill.
//
// Why an outbox: a service that charges a card or sends a mail straight from
// its request handler can commit its database change and then crash before
// the call, or make the call and then fail to commit. Either way the system
// lies. With Ferry the handler writes the business row and an event row in
// one PostgreSQL transaction; both commit or neither does. A relay moves
// committed events to RabbitMQ, at least once, and consumer handlers guarded
// by a durable idempotency ledger turn "at least once" into "exactly one
// effect".
//
// The packages, from the inside out:
//
//   - pipeline: message metadata, backoff, error classification and the
//     topic and payload rules; it speaks only Watermill's message package
//     and the standard library.
//   - pipeline/pgoutbox: publishing into the outbox inside the caller's
//     transaction, the relay that claims and forwards rows, and the
//     operator's reads and actions on pending rows; each table has one
//     owner package (pgoutbox, pgpoison, pgledger, pgaudit, pgtoolcalls,
//     pgbudget), and pgstatus is the one reader for reports.
//   - pipeline/pgcdc: the relay fed by logical replication instead of polls.
//   - pipeline/rabbit: RabbitMQ topology, publisher and consumer.
//   - handlers, middleware: what runs on the consumer side, and the chain
//     around it.
//   - agenttools: agent tools (MCP and HTTP) whose idempotency key comes from
//     the host.
//   - adoption/cutoff, adoption/shadow, adoption/backfill: adopting Ferry in
//     a service that already runs.
//   - app: configuration and wiring, the composition root; cli: the
//     operations commands a service's binary embeds; console: the operator's
//     web console; ferrytest: helpers for a service's own tests.
//
// The example service (examples/orders, run by `ferry demo`) and a service
// of one's own (examples/invoices) stand on this API alone.
package ferry
