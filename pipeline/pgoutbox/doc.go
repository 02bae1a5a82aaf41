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
// event. The Relay here reads the rows committed since its position, a
// snapshot kept per outbox table, and moves the position past them in the
// batch's transaction once the broker confirmed them: a row sent at its
// first try is never updated, so a long transaction elsewhere on the server
// leaves the relay no dead tuple to walk (lanes.go). Rows that need state of
// their own (a failed publish, a delay, an ordered aggregate's held row) go
// to the slow lane, claimed FOR UPDATE SKIP LOCKED and marked dispatched
// one by one. Several relays share an outbox table: one at a time moves the
// position, the others work the slow lane meanwhile; a crashed relay's
// locks vanish with its connection, and its position did not move.
package pgoutbox
