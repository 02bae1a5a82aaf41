// Package app is Ferry's composition root: configuration from the
// environment, the wiring of pool, outbox, relay, router and HTTP API, and
// their lifecycle. cmd/ferry is a thin shell around it.
//
// Nothing imports app; it imports everything. The route table (Routes) and
// the middleware chain (Options.Chain) are where an application plugs in.
package app
