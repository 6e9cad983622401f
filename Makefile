# proxyfleet — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

GO       ?= go
BIN      := $(CURDIR)/bin
MODULES  := pkg $(wildcard services/*) e2e
MODULE_PATTERNS := $(addprefix ./,$(addsuffix /...,$(MODULES)))
# SERVICES are the modules with a binary (services/<name>/cmd/<name>).
SERVICES := $(notdir $(patsubst %/cmd,%,$(wildcard services/*/cmd)))
NATSCLI_VERSION := v0.5.0
STATICCHECK_VERSION := v0.8.2
GOTEST_FLAGS ?= -race -count=1 -timeout 35m
# -trimpath for every go command make runs (and the tests' own go builds,
# which inherit it): files are named by module path, not by where the
# checkout is, so every checkout of the tree shares one build cache, and
# no binary carries a path of the machine that built it. Without it each
# fresh clone (every CI run is one, at a new path) compiled every package
# of the tree again, once per variant: lint and each tier, about a tenth of
# a warm CI run's CPU.
#
# And no DWARF from the compiler (-gcflags=all=-dwarf=false): stack traces,
# panics and profiles use the function tables, which stay; only debuggers
# read DWARF. A cold build of the planner took 158 CPU seconds instead of
# 178 with it (a whole cold CI run showed no saving beyond its run-to-run
# spread; mk/README). DWARF=1 keeps it, for a debugger: make build DWARF=1.
NO_DWARF := -gcflags=all=-dwarf=false
export GOFLAGS := -trimpath $(if $(DWARF),,$(NO_DWARF)) $(filter-out -trimpath $(NO_DWARF),$(GOFLAGS))

# Tiers added by mk/*.mk files; each appends its target to TEST_ALL_TIERS
# and says what it needs beyond the Go toolchain (mk/README).
TEST_ALL_TIERS :=

# The Debian packages the tiers install, appended by each tier file, so
# `make packages` installs them all in one apt-get run (CI does, first).
# Those that the kvm tiers' scripts install with their recommended
# packages (libvirt's dnsmasq and firewall tools) go in the second list.
APT_INSTALL := $(CURDIR)/scripts/apt-install.sh
DEBIAN_PACKAGES :=
DEBIAN_PACKAGES_RECOMMENDS :=

# The cached prerequisites (mk/README): each tier file appends a name to
# PREREQS and defines PREREQ_TARGET_<name> (the make target that builds it)
# and PREREQ_CHECK_<name> (a command that succeeds when it is cached).
PREREQS :=

# $(call cache_lock,LOCKFILE) opens a cached build's recipe: it takes the
# lock and stops if the target appeared while it waited, so two makes (CI's
# prerequisite builder and a tier that needs the same thing) build it once.
cache_lock = exec 9>$(1); flock 9; if [ -e $@ ]; then exit 0; fi; set -e;

.PHONY: help
help: ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z0-9_-]+:.*## /{printf "  \033[36m%-22s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "make run's knobs (docs/local.md): PROXYFLEET_RUN_DIR (.run), PROXYFLEET_NATS_ADDR (127.0.0.1:4222),"
	@echo "PROXYFLEET_ECHO_ADDR (127.0.0.1:8480), PROXYFLEET_GATEWAY_ADDR (127.0.0.1:8888), PROXYFLEET_CONSOLE_ADDR (127.0.0.1:8090),"
	@echo "PROXYFLEET_PORTS (20000-20999),"
	@echo "PROXYFLEET_LOG_LEVEL (info);"
	@echo "port 0 lets the kernel pick. More flags per service: PLANNER_FLAGS, HEALTH_FLAGS, AGENT_FLAGS, GATEWAY_FLAGS, CONSOLE_FLAGS, e.g."
	@echo '  make run AGENT_FLAGS="--source-addrs 203.0.113.10,203.0.113.11 --squid /usr/sbin/squid"'

# The binaries make run starts; `make build` builds every service.
RUN_SERVICES := planner health local-agent gateway console

.PHONY: build
build: $(addprefix build-,$(SERVICES)) ## build every service binary into ./bin

# VERSION is what every service announces (semver), derived from RELEASES
# by scripts/version.sh: a release's commit is its version (0.1.0), any
# other the next minor's pre-release with the commit (0.2.0-dev+<commit>);
# each binary's --version prints it (docs/upgrading.md).
VERSION ?= $(shell ./scripts/version.sh)

# BUILD_TAGS are the build tags of every service binary. grpcnotrace keeps
# golang.org/x/net/trace out (gRPC arrives with the OTLP exporters and the
# Google API transport): its init registers HTML handlers whose templates
# make the linker keep every exported method of every type, which costs
# each service 3-8 MB of idle memory (docs/performance.md#memory).
BUILD_TAGS := grpcnotrace
# Every build without the race detector uses them too (lint, the tests'
# own builds of the services, the tiers that test without -race), so one
# such variant of the dependencies is compiled, not two.

# build-<service> builds one service into ./bin (go's build cache makes it
# cheap when nothing changed).
.PHONY: $(addprefix build-,$(SERVICES))
$(addprefix build-,$(SERVICES)): build-%:
	@mkdir -p $(BIN)
	@if [ -z "$(VERSION)" ]; then echo "no VERSION: scripts/version.sh failed (see above; RELEASES, docs/upgrading.md)"; exit 1; fi
	@echo "go build $*"; cd services/$* && $(GO) build -tags "$(BUILD_TAGS)" -ldflags "-X proxyfleet/pkg/buildinfo.Version=$(VERSION)" -o $(BIN)/$* ./cmd/$*

# The pinned nats CLI is built once per machine into a cache outside the
# checkout (like kube-apiserver in mk/cloud.mk), so `make clean` and fresh
# clones do not rebuild it; ./bin/nats is a link to it.
CACHE_DIR   ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/proxyfleet
NATSCLI_BIN := $(CACHE_DIR)/nats-$(NATSCLI_VERSION)

$(NATSCLI_BIN):
	@mkdir -p $(CACHE_DIR)
	@$(call cache_lock,$@.lock) \
		echo "building the nats CLI $(NATSCLI_VERSION) into $(CACHE_DIR) (once per machine)"; \
		tmp=$$(mktemp -d $(CACHE_DIR)/.nats-build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
		GOBIN="$$tmp" $(GO) install -trimpath -ldflags '-s -w' github.com/nats-io/natscli/nats@$(NATSCLI_VERSION); \
		mv -f "$$tmp/nats" $@

# The pinned nats-server (the version pkg/go.mod embeds), built once per
# machine into the cache by mk/deploy.mk for the deploy and cluster tiers.
# Defined here, before the mk/*.mk files: a prerequisite is expanded when
# its rule is read, and cluster.mk is read before deploy.mk.
NATSSERVER_VERSION := $(shell awk '$$1=="github.com/nats-io/nats-server/v2"{print $$2; exit}' pkg/go.mod)
NATSSERVER_BIN     := $(CACHE_DIR)/nats-server-$(NATSSERVER_VERSION)

PREREQS += nats-cli
PREREQ_TARGET_nats-cli := nats
PREREQ_CHECK_nats-cli  := test -x $(NATSCLI_BIN)

$(BIN)/nats: $(NATSCLI_BIN)
	@mkdir -p $(BIN)
	@ln -sfn $(NATSCLI_BIN) $@

.PHONY: nats
nats: $(BIN)/nats ## link the pinned nats CLI into ./bin/nats (built once into ~/.cache/proxyfleet)

.PHONY: run
run: $(addprefix build-,$(RUN_SERVICES)) $(BIN)/nats ## start NATS (embedded), planner, health, local-agent, the gateway and the console (http://127.0.0.1:8090); Ctrl-C stops them (knobs: docs/local.md)
	@./scripts/run.sh

.PHONY: rebuild-views
rebuild-views: ## have the running make run rebuild health's views from the event log
	@./scripts/run.sh rebuild-views

.PHONY: logs
logs: ## the last warnings and errors of make run's services and of every proxy
	@./scripts/logs.sh

# e2e/run_test.go drives scripts/run.sh, whose commands use the nats CLI.
.PHONY: test
test: $(BIN)/nats ## unit and integration tests (embedded NATS, real processes), no root needed
	@for m in $(MODULES); do \
		echo "== go test $$m"; (cd $$m && $(GO) test $(GOTEST_FLAGS) $${GOTEST_SELECT:+$$GOTEST_SELECT "$$GOTEST_PATTERN"} ./...) || exit 1; \
	done

# make fuzz runs every Go fuzz target (func FuzzX(f *testing.F) in a
# _test.go file of any module) for FUZZTIME each, one after another; FUZZ
# (an extended regexp) keeps the targets whose "<package dir> <name>" it
# matches, e.g. make fuzz FUZZ=cloudinit FUZZTIME=5m. A failing input is
# written under the package's testdata/fuzz/<name>/ and then runs as a seed
# in make test. Their seeds run in make test anyway (docs/security.md#fuzzing).
FUZZTIME  ?= 60s
FUZZ      ?= .
FUZZFLAGS ?=

.PHONY: fuzz
fuzz: ## run each fuzz target for FUZZTIME (60s), one after another (FUZZ=regexp selects; docs/security.md)
	@set -e; list=$$(for m in $(MODULES); do \
		grep -rlE --include='*_test.go' '^func Fuzz[A-Za-z0-9_]*\(f \*testing\.F\)' $$m | while read -r file; do \
			sed -nE 's/^func (Fuzz[A-Za-z0-9_]*)\(f \*testing\.F\).*/\1/p' "$$file" | \
				while read -r fn; do echo "$$(dirname "$$file") $$fn"; done; \
		done; \
	done | sort | grep -E -- '$(FUZZ)' || true); \
	if [ -z "$$list" ]; then echo "no fuzz target matches FUZZ=$(FUZZ)"; exit 1; fi; \
	echo "fuzz targets ($$(echo "$$list" | wc -l), $(FUZZTIME) each):"; echo "$$list" | sed 's/^/  /'; \
	echo "$$list" | while read -r dir fn; do \
		m=$$(for mod in $(MODULES); do case "$$dir/" in "$$mod"/*) echo "$$mod";; esac; done | tail -1); \
		echo "== $$dir $$fn"; \
		(cd "$$m" && $(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $(FUZZFLAGS) "./$${dir#$$m/}") || exit 1; \
	done

# Tier files must be read before test-all expands TEST_ALL_TIERS.
-include mk/*.mk

.PHONY: print-modules
print-modules:
	@echo $(MODULES)

.PHONY: ci
ci: ## what CI runs (.ci/run): lint, tidy-check, test and every tier, prerequisites built meanwhile, a table of seconds at the end (root)
	@PROXYFLEET_REQUIRE_INTEGRATION=1 ./scripts/ci.sh

.PHONY: test-all
test-all: test $(TEST_ALL_TIERS) ## test plus the real-component tiers (needs root; installs Debian packages)

.PHONY: packages
packages: ## install every Debian package the tiers use, in one apt-get run (root; starts no service)
	@$(APT_INSTALL) $(sort $(DEBIAN_PACKAGES))
	@$(APT_INSTALL) --with-recommends $(sort $(DEBIAN_PACKAGES_RECOMMENDS))

PREREQS += debian-packages
PREREQ_TARGET_debian-packages := packages
PREREQ_CHECK_debian-packages  := ! dpkg-query -W -f='$${db:Status-Status}\n' $(sort $(DEBIAN_PACKAGES) $(DEBIAN_PACKAGES_RECOMMENDS)) 2>/dev/null | grep -qv '^installed$$'

# The modules of the workspace and of the tools built into the cache.
TOOL_MODULES := $(KUBE_MODULE) $(OTEL_MODULE)

.PHONY: mod-download
mod-download: ## download every Go module the workspace and the cached tools need
	@for m in $(MODULES); do (cd $$m && $(GO) mod download) || exit 1; done
	@for m in $(TOOL_MODULES); do (cd $$m && GOWORK=off $(GO) mod download) || exit 1; done

PREREQS += go-modules
PREREQ_TARGET_go-modules := mod-download
PREREQ_CHECK_go-modules  := test -n "$$(ls -A "$$($(GO) env GOMODCACHE)/cache/download" 2>/dev/null)"

# ci-plan is what .ci/run reads: the tiers with their lane (TIER_LANE_<tier>,
# main unless a tier file says otherwise) and what each needs, and the
# cached prerequisites with the target that builds each; prereq-cached-<name>
# succeeds when that prerequisite is already in the cache.
.PHONY: ci-plan
ci-plan:
	@$(foreach t,$(TEST_ALL_TIERS),echo 'tier $(t) $(or $(TIER_LANE_$(t)),main) $(TIER_NEEDS_$(t))';)
	@$(foreach p,$(PREREQS),echo 'prereq $(p) $(PREREQ_TARGET_$(p))';)

.PHONY: $(addprefix prereq-cached-,$(PREREQS))
$(addprefix prereq-cached-,$(PREREQS)): prereq-cached-%:
	@$(PREREQ_CHECK_$*)

.PHONY: lint
lint: ## gofmt, go vet and staticcheck on every module
	@out=$$(gofmt -l $(MODULES)); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@# One vet and one staticcheck over every module of the workspace (the
	@# same build list as a run per module, since go.work applies inside each
	@# module too): one process compiles the shared dependencies once and
	@# keeps both cores busy to the end.
	@# With the services' build tags, so that lint compiles the variant of
	@# the dependencies that make build and the tiers use.
	@$(GO) vet -tags "$(BUILD_TAGS)" $(MODULE_PATTERNS)
	@$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) -tags "$(BUILD_TAGS)" $(MODULE_PATTERNS)

.PHONY: compile-race
compile-race: ## compile every package of the tree, its tests and their dependencies with the race detector into go's build cache (what make test links), linking nothing
	@# CI runs this before its lanes: they would otherwise compile the
	@# dependencies they share side by side, each its own copy, on a cold cache.
	@$(GO) list -race -test -export -deps $(MODULE_PATTERNS) >/dev/null

.PHONY: tidy-check
tidy-check: ## fail if any go.mod or go.sum is not tidy
	@for m in $(MODULES); do \
		(cd $$m && cp go.mod /tmp/pf-go.mod.bak && { cp go.sum /tmp/pf-go.sum.bak 2>/dev/null || true; } && \
		$(GO) mod tidy && \
		if ! git diff --quiet -- go.mod go.sum; then echo "$$m: go mod tidy changes go.mod/go.sum"; git diff -- go.mod go.sum | head -40; exit 1; fi) || exit 1; \
	done

.PHONY: bench
# The e2e module's benchmarks start every service as a process (idle RSS,
# the end-to-end converge of a 10,000-proxy pool): more than go test's
# default 10-minute bound on a busy machine.
bench: ## Go benchmarks of every module (idle RSS, end-to-end converge), with ratios against baselines measured in the same run (PROXYFLEET_BENCH_CONVERGE_SIZE, PROXYFLEET_BENCH_PROFILE_DIR: docs/performance.md)
	@mkdir -p $(BIN)
	@set -o pipefail; for m in $(MODULES); do (cd $$m && $(GO) test -run '^$$' -bench . -benchmem -timeout 60m ./...) || exit 1; done | tee $(BIN)/bench.txt
	@awk -f scripts/bench-ratios.awk $(BIN)/bench.txt
	@awk -f scripts/bench-table.awk $(BIN)/bench.txt

# make run's state directory (scripts/run.sh reads the same variable).
RUN_DIR ?= $(or $(PROXYFLEET_RUN_DIR),.run)

.PHONY: clean
clean: ## remove ./bin and make run's state (./.run; the nats CLI stays cached); refuses while proxies of make run still run
	@./scripts/clean.sh check "$(RUN_DIR)"
	rm -rf $(BIN) "$(RUN_DIR)"

.PHONY: clean-proxies
clean-proxies: ## stop the proxy processes make run left running and remove their state
	@./scripts/clean.sh stop "$(RUN_DIR)"

