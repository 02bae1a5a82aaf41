// Package bench is `ferry bench`: the benchmark scenarios (relay and
// producer throughput, consumer cost, end-to-end latency and drain, memory,
// peers side by side) run against the real servers, printing one JSON
// object per scenario. Speed and memory targets live here, compared as
// ratios measured in the same run, never in a timed unit test.
package bench
