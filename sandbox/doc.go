// Package sandbox runs, in process, the outside world that `ferry demo` and
// the tests talk to: a payment provider over HTTP and an SMTP server. Both
// record everything that arrives, so a duplicate effect is observable
// instead of hidden.
//
// They are real servers on loopback ports, reached through the same HTTP and
// SMTP clients production uses.
package sandbox
