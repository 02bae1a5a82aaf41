.PHONY: help test test-race test-norace test-renamed test-short lint demo bench chaos chaos-long chaos-network mutations mutations-all build ci

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

test: ## run every test against the local PostgreSQL and RabbitMQ
	go test ./...

test-race: ## the same with the race detector, then the three tests too slow under it (CI's test steps; `make ci` is all of CI)
	go test -race -count=1 -timeout 20m ./...
	$(MAKE) test-norace

test-norace: ## the broker-restart, black-hole publisher, CDC broker-cut and node-loss tests, which run without -race (see their files)
	go test -count=1 -run '^(TestPubSubReconnect|TestAPublisherBehindABlackHoleFailsFastAfterItsFirstTimeout)$$' ./pipeline/rabbit/
	go test -count=1 -run '^TestBrokerCutHoldsTheConfirmedPosition$$' ./pipeline/pgcdc/
	go test -count=1 -run '^TestBrokerNodeLossLosesAndDoublesNothing$$' ./examples/orders/ordersapp/

test-renamed: ## the suites that read or write the outbox, with it renamed (CI runs this too)
	FERRY_TEST_OUTBOX_TABLE=ferry_events go test -count=1 -timeout 10m -skip '^TestLargeTransactionIsStreamed$$' \
	  ./pipeline/pgoutbox/ ./pipeline/pgstatus/ ./pipeline/pgretention/ ./pipeline/pgcdc/ ./cli/ ./console/ ./app/ ./ferrytest/

test-short: ## unit tests only (skips those needing servers)
	go test -short ./...

lint: ## gofmt, go vet and ferrylint (no side effect in an agent tool body)
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || (gofmt -l $$(git ls-files '*.go'); exit 1)
	go vet ./...
	go run ./cmd/ferrylint ./...

demo: ## run the end-to-end demo
	go run ./cmd/ferry demo

bench: ## the benchmark (JSON on stdout, table on stderr)
	go run ./cmd/ferry bench

chaos: ## the short fault-injection run
	go run ./cmd/ferry chaos

chaos-long: ## the long fault-injection run (10,000 orders, broker restarts)
	go run ./cmd/ferry chaos --long

chaos-network: ## faults the network makes, through Toxiproxy, for 10 minutes
	go run ./cmd/ferry chaos --network --long

mutations: ## each mutation of docs/reliability.md's table with a quick test, applied alone: its test must fail
	bash .ci/mutations

mutations-all: ## the same, with those whose test is a chaos run (about 10 minutes more)
	bash .ci/mutations --all

build: ## build bin/ferry
	go build -o bin/ferry ./cmd/ferry

ci: ## what CI runs
	bash .ci/run
