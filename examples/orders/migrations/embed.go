// Package migrations holds the orders example's own tables, migrated beside
// Ferry's with their own version table: an application's tables never go
// into Ferry's migration history.
package migrations

import (
	"embed"

	ferrymigrations "github.com/ferry-dev/ferry/migrations"
)

//go:embed *.sql
var fsys embed.FS

// Set is the example's migration set (app.Options.Migrations).
var Set = ferrymigrations.Set{Name: "orders-example", FS: fsys, VersionTable: "orders_example_schema_version"}
