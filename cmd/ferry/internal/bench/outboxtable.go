package bench

import "github.com/ferry-dev/ferry/pipeline/pgoutbox"

// outboxSQL is the outbox the bench loads, empties and measures: the
// default table, which the bench's schemas migrate.
var outboxSQL = pgoutbox.Table{}.Quoted()
