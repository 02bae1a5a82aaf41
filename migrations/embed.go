// Package migrations holds Ferry's SQL schema as numbered goose migrations,
// embedded in the binary so `ferry migrate up` needs no files on disk.
//
// The outbox table is Ferry's own (its operational columns and partial
// indexes are the point of the design), so it is created here and never by
// watermill-sql's AutoInitializeSchema.
package migrations

import "embed"

// FS holds every migration file, in goose's "NNNNN_name.sql" form.
//
//go:embed *.sql
var FS embed.FS
