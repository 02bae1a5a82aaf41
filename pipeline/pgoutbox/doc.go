// Package pgoutbox is the PostgreSQL side of the outbox: publishing events
// inside the caller's transaction, and the relay that forwards committed rows
// to a broker.
//
// Publishing goes through Watermill's SQL publisher (watermill-sql/v3) bound
// to the caller's transaction, with a schema adapter of its own writing
// Ferry's outbox table; the business write and its events commit or roll
// back together.
//
// Relaying does not use watermill-sql's subscriber or Watermill's forwarder
// component. The stock subscriber serialises all consumers of a topic on one
// offsets row and reads per-topic message tables, so relays cannot share the
// work, and the forwarder keeps no attempts, last error or backoff per
// event. The Relay here claims due rows with FOR UPDATE SKIP LOCKED over the
// partial index on pending rows: several relays (goroutines or processes)
// take disjoint batches, a crashed relay's locks vanish with its connection,
// and a row is marked dispatched only after the broker confirmed it.
package pgoutbox
