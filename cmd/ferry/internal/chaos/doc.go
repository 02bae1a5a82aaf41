// Package chaos is `ferry chaos`: the example service run as separate
// processes under load while faults are injected (kills, rolling restarts,
// database and broker outages, slow and failing providers), then checked:
// nothing lost, nothing run twice, order kept per aggregate.
package chaos
