// Package pipeline is the core of Ferry: what every other package agrees on.
//
// It defines the metadata keys an event carries from the outbox row to the
// consumer (aggregate id, correlation and trace ids, schema version, tenant),
// how an event is built inside a request (NewEvent), the relay's retry
// schedule (Backoff) and the Permanent error marker that tells "never retry"
// from "try again".
//
// It depends only on Watermill's message package and the standard library;
// PostgreSQL and RabbitMQ code lives in its subpackages so that the arrows
// point inward.
package pipeline
