// Package republish marks the contexts of Ferry's own writes of a message
// that already went through the pipeline once (a durable retry, a requeue
// from the poison store): only those may carry Ferry's reserved metadata
// (pipeline.ReservedMetadata) into the outbox. It is internal so that no
// producer can make such a context: the key type cannot be named outside.
package republish

import "context"

type key struct{}

// Context returns ctx marked as a republish by Ferry itself.
func Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, key{}, true)
}

// Is reports whether ctx was marked by Context.
func Is(ctx context.Context) bool {
	v, _ := ctx.Value(key{}).(bool)
	return v
}
