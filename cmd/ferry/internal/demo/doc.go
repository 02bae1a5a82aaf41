// Package demo is `ferry demo`: the example service end to end in one
// process, in a schema of its own, with a duplicate delivery forced, and a
// summary that checks each side effect happened exactly once.
package demo
