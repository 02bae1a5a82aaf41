// Package handlers is how consumer handlers are described and registered:
// a Route per handler (name, topic, ordered or not, its own middleware) and
// Typed, which decodes a message's JSON payload into the handler's event
// type before the handler sees it.
//
// A handler's name is part of the deployment: it names its queue and keys
// its idempotency ledger, so renaming one is a breaking change (the new
// queue starts empty and the ledger forgets what the old name processed).
//
// The example service's handlers live in examples/orders (charge, mail);
// each declares the narrow interface it needs and has no idea of RabbitMQ
// or PostgreSQL.
package handlers
