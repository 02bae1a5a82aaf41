// Package app is Ferry's composition root: configuration from the
// environment, the wiring of pool, outbox, relay, router and HTTP API, and
// their lifecycle. cmd/ferry is a thin shell around it.
//
// It imports the library's packages; only a service's main, the cli
// package, ferrytest and the examples import it. The route table
// (Options.Routes) and the middleware chain (Options.Chain) are where an
// application plugs in.
package app
