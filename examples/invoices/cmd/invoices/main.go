// Command invoices is the invoices service: Ferry's operations commands
// (run, relay, consume, migrate, status, poison, prune, healthcheck) with
// the service's own route table, chain link and migrations.
package main

import (
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/examples/invoices"
)

// snippet:begin main
func main() {
	cli.Main(cli.Options{
		Name:        "invoices",
		Description: "issues invoices and marks them sent, through Ferry's outbox",
		App:         func() (app.Options, error) { return invoices.Options(), nil },
	})
}

// snippet:end main
