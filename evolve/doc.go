// Package evolve keeps events readable after their type changes: an event
// type's versions as a chain of steps (typed, func(Old) (New, error), or on
// the raw JSON) that bring any stored version to the one the code has, so
// that a handler sees only the current type, whatever version an event was
// written as, days ago, and wherever it waited (the outbox, a durable
// retry, the poison store, a backfill).
//
// A Chain is validated when built (no gap, no duplicate step, typed
// neighbours agree, the last step produces the handler's type); the
// handlers package decodes through it (handlers.Evolving), producers stamp
// its current version (Chain.NewEvent), and Check compares the code's event
// types with a committed Snapshot under a compatibility mode, for `ferry
// schema check` in a service's CI.
package evolve
