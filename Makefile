# proxyfleet — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

GO       ?= go
BIN      := $(CURDIR)/bin
MODULES  := pkg $(wildcard services/*) e2e
SERVICES := $(notdir $(wildcard services/*))
NATSCLI_VERSION := v0.5.0
STATICCHECK_VERSION := v0.8.2
GOTEST_FLAGS ?= -race -count=1 -timeout 20m

# Tiers added by mk/*.mk files; each appends its target to TEST_ALL_TIERS.
TEST_ALL_TIERS :=

.PHONY: help
help: ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z0-9_-]+:.*## /{printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## build every service binary into ./bin
	@mkdir -p $(BIN)
	@for s in $(SERVICES); do \
		if [ -d services/$$s/cmd/$$s ]; then \
			echo "go build $$s"; (cd services/$$s && $(GO) build -o $(BIN)/$$s ./cmd/$$s) || exit 1; \
		fi; \
	done

$(BIN)/nats:
	@mkdir -p $(BIN)
	GOBIN=$(BIN) $(GO) install github.com/nats-io/natscli/nats@$(NATSCLI_VERSION)

.PHONY: nats
nats: $(BIN)/nats ## build the pinned nats CLI into ./bin/nats

.PHONY: run
run: build $(BIN)/nats ## start NATS (embedded), planner, health and local-agent; Ctrl-C stops them
	@./scripts/run.sh

.PHONY: test
test: ## unit and integration tests (embedded NATS, real processes), no root needed
	@for m in $(MODULES); do \
		echo "== go test $$m"; (cd $$m && $(GO) test $(GOTEST_FLAGS) ./...) || exit 1; \
	done

# Tier files must be read before test-all expands TEST_ALL_TIERS.
-include mk/*.mk

.PHONY: test-all
test-all: test $(TEST_ALL_TIERS) ## test plus the real-component tiers (needs root; installs Debian packages)

.PHONY: lint
lint: ## gofmt, go vet and staticcheck on every module
	@out=$$(gofmt -l $(MODULES)); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@for m in $(MODULES); do (cd $$m && $(GO) vet ./...) || exit 1; done
	@for m in $(MODULES); do (cd $$m && $(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...) || exit 1; done

.PHONY: tidy-check
tidy-check: ## fail if any go.mod or go.sum is not tidy
	@for m in $(MODULES); do \
		(cd $$m && cp go.mod /tmp/pf-go.mod.bak && { cp go.sum /tmp/pf-go.sum.bak 2>/dev/null || true; } && \
		$(GO) mod tidy && \
		if ! git diff --quiet -- go.mod go.sum; then echo "$$m: go mod tidy changes go.mod/go.sum"; git diff -- go.mod go.sum | head -40; exit 1; fi) || exit 1; \
	done

.PHONY: bench
bench: ## Go benchmarks of every module, with ratios against baselines measured in the same run
	@mkdir -p $(BIN)
	@for m in $(MODULES); do (cd $$m && $(GO) test -run '^$$' -bench . -benchmem ./...) || exit 1; done | tee $(BIN)/bench.txt
	@awk -f scripts/bench-ratios.awk $(BIN)/bench.txt

# make run's state directory (scripts/run.sh reads the same variable).
RUN_DIR ?= $(or $(PROXYFLEET_RUN_DIR),.run)

.PHONY: clean
clean: ## remove ./bin and make run's state (./.run); refuses while proxies of make run still run
	@./scripts/clean.sh check "$(RUN_DIR)"
	rm -rf $(BIN) "$(RUN_DIR)"

.PHONY: clean-proxies
clean-proxies: ## stop the proxy processes make run left running and remove their state
	@./scripts/clean.sh stop "$(RUN_DIR)"

