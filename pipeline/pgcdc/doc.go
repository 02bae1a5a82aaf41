// Package pgcdc is the CDC relay: it streams committed outbox INSERTs from
// PostgreSQL's WAL (logical decoding, the pgoutput plugin, through
// github.com/jackc/pglogrepl) and hands them to the polling relay's
// RelayIDs, which locks them by primary key, publishes and marks them
// dispatched. No claim scan, no poll, no NOTIFY on the hot path.
//
// It is exactly as safe as the polling relay, by these rules:
//
//   - The slot's confirmed flush position moves only past transactions
//     whose rows were all resolved: confirmed by the broker and marked
//     dispatched, or left pending in the outbox for the polling relay
//     (delayed rows, rows behind an earlier pending row of an ordered
//     aggregate, rows whose publish failed, recorded with backoff). When
//     the broker confirms nothing (an outage), nothing is recorded and the
//     position holds: the same rows are tried again.
//   - A crash anywhere replays from the confirmed position: at least once.
//     Rows already marked dispatched are skipped, not sent again.
//   - The polling relay keeps running as the safety net, at a low rate and
//     only for rows older than a grace period (RelayConfig.MinAge): it
//     relays what the stream left, and everything if the slot is lost.
//   - One streamer per slot: PostgreSQL lets one walsender use a slot at a
//     time, so a second process stands by, retrying, and takes over when
//     the first one's connection goes.
//   - When no outbox change flows, a heartbeat (pg_logical_emit_message)
//     gives the stream a position to confirm, so the slot does not retain
//     the WAL of unrelated writes.
package pgcdc
