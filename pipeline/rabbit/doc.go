// Package rabbit is the RabbitMQ side of Ferry's pipeline: connection
// settings, the topology (exchanges, queues, bindings) and a marshaler that
// never refuses a delivery.
//
// Topology: every topic is a durable direct exchange; every consumer
// handler owns a durable quorum queue, named after the handler, bound to
// its topic's exchange. Several handlers on one topic each get every event.
// Each topic exchange has an alternate exchange, "ferry.unrouted", with a
// queue of the same name: RabbitMQ confirms a message that no queue takes
// and then drops it, so the alternate exchange is what keeps a message
// published before its consumers' queues exist. Declare the topology from
// the route table before relaying, and watch ferry.unrouted's depth.
//
// All names can be prefixed with a namespace, so that several environments
// (or tests) share one broker without seeing each other.
package rabbit
