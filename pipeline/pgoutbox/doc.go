// Package pgoutbox is the PostgreSQL side of the outbox: publishing events
// inside the caller's transaction, the relay that forwards committed rows
// to a broker, and every statement over the outbox table and the tables
// beside it (its one owner).
//
// Publishing goes through Watermill's SQL publisher (watermill-sql/v3)
// bound to the caller's transaction, with a schema adapter of its own
// writing Ferry's outbox table; the business write and its events commit or
// roll back together.
//
// Relaying does not use watermill-sql's subscriber or Watermill's forwarder
// component. The stock subscriber serialises all consumers of a topic on one
// offsets row and reads per-topic message tables, so relays cannot share the
// work, and the forwarder keeps no attempts, last error or backoff per
// event. The Relay here reads the rows committed since its position, a
// snapshot kept per outbox table, and moves the position past them in the
// batch's transaction once the broker confirmed them: a row sent at its
// first try is never updated, so a long transaction elsewhere on the server
// leaves the relay no dead tuple to walk. Three lanes share one publish →
// record step: the append-only lane (rows committed past the position), the
// slow lane (rows with state of their own: a failed publish, a delay, an
// ordered aggregate's held row, claimed FOR UPDATE SKIP LOCKED and marked
// one by one) and the id lane (rows the CDC relay hands in by id). Several
// relays share an outbox table: one at a time moves the position, the
// others work the slow lane meanwhile; a crashed relay's locks vanish with
// its connection, and its position did not move.
//
// # Reading order
//
// The files, in the order to read them (TestPackageDocListsEveryFile keeps
// the list whole):
//
//   - table.go: Table, the handle every statement takes its names from.
//   - outbox.go, schema_adapter.go: publishing in the caller's transaction.
//   - commit.go, pgxtx.go: InTx and publishing through a pgx.Tx.
//   - jsonb.go: which payloads jsonb can hold.
//   - waker.go, commitwatch.go: the wake-up after a commit, and how a
//     watched pool tells a commit nobody announced.
//   - lanes.go: how the relay finds rows without marking them; what
//     "pending" means.
//   - relay.go: the Relay, RelayBatch.
//   - config.go: RelayConfig, its defaults and bounds.
//   - appendlane.go: the append-only lane, step by step.
//   - slowlane.go: the slow lane.
//   - idlane.go: the id lane (RelayIDs, for the CDC relay).
//   - publish.go: the step the lanes share: publish, then record.
//   - services.go: the batches in flight, the idle wait, LISTEN and the
//     watches.
//   - failover.go: the replay after a failover.
//   - compat.go: paths kept for earlier relays and rows (and when they go).
//   - stmt_pending.go, stmt_claim.go, stmt_page.go, stmt_position.go,
//     stmt_record.go: the statements, by family.
//   - reads.go, reads_find.go: the typed reads status, the console, the CLI
//     and tests ask.
//   - views.go: the operator views per row state.
//   - operate.go: the operator's actions on failing rows and retries.
//   - partitions.go: retention by whole partitions.
//   - rescheduler.go: durable retries written back into the outbox.
package pgoutbox
