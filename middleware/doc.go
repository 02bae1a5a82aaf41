// Package middleware is Ferry's consumer-side middleware chain: Watermill
// HandlerMiddleware, one file each, and the one function (DefaultChain) that
// fixes their order.
//
// The chain turns the broker's at-least-once delivery into one effect per
// message and makes every failure end somewhere visible: a message is acked
// only when its handler succeeded, when the ledger says it already had, or
// when it is safely in the poison queue with its reason.
package middleware
