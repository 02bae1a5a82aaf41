// Package agenttools turns a domain operation into an agent tool that can only
// write intents. A tool is defined once in Go (name, description, typed
// input and output, whose JSON Schemas are generated from the Go types) with
// a body that receives the business transaction and an Emitter bound to
// it: the only way out of the body is an intent in the outbox, immediate
// or delayed, committed with the business rows or not at all.
//
// The Runner owns the transaction and the idempotency. The key comes from
// the host (MCP request _meta "dev.ferry/idempotency-key", or the
// Idempotency-Key header over HTTP), never from the model, which invents a
// new key on every retry; it is not part of the input schema. A call record
// (tool, key, SHA-256 of the canonical arguments, result, intent ids) is
// written in the same transaction: the same key with the same arguments
// returns the stored result marked as a replay, with no new business row and
// no new intent; the same key with other arguments is refused
// (ErrKeyConflict); concurrent calls with one key wait on the record's
// primary key and produce one effect and one answer. Input is decoded
// strictly and validated before any write; errors name each bad field.
//
// IntentStatus is the read-only tool that tells an agent how its intents
// are doing (pending, scheduled, dispatched, handled by which handler,
// retrying with the last error, poisoned with the reason), so it checks
// progress instead of calling again. Package tools/mcptools serves a
// Runner's tools over MCP; HTTPHandler serves them as plain JSON.
package agenttools
