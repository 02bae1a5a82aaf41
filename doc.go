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
//   - pipeline: message metadata, backoff and error classification; it speaks
//     only Watermill's message package and the standard library.
//   - pipeline/pgoutbox: publishing into the outbox inside the caller's
//     transaction, and the relay that claims and forwards rows.
//   - pipeline/pgledger: the consumers' processed_messages ledger.
//   - pipeline/rabbit: RabbitMQ topology, configuration and marshaling.
//   - handlers, middleware: what runs on the consumer side, and the chain
//     around it.
//   - orders: an example domain (create_order) used by `ferry demo`.
//   - app: configuration and wiring, the composition root for cmd/ferry.
package ferry
