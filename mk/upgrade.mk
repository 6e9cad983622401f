# Upgrade tier (docs/upgrading.md): the previous release, built from the
# repository's own history, upgraded service by service to the current
# tree while a client sends traffic through the gateway.
#
# The previous release is the latest one in RELEASES whose commit is not
# HEAD (RELEASES lists them oldest first). Its binaries are built once
# per machine from a git worktree at its commit into the cache, keyed by
# the commit, stamped with the release's version; make clean keeps them.

UPGRADE_SERVICES := planner health local-agent gateway
PREV_RELEASE := $(shell awk -v h="$$(git rev-parse HEAD 2>/dev/null)" '!/^[ \t]*(\#|$$)/ && $$2 != h { v = $$1; c = $$2 } END { if (c != "") print v, c }' RELEASES 2>/dev/null)
PREV_VERSION := $(word 1,$(PREV_RELEASE))
PREV_COMMIT  := $(word 2,$(PREV_RELEASE))
PREV_BIN_DIR := $(CACHE_DIR)/release-$(or $(PREV_COMMIT),none)

# $(CACHE_DIR)/release-<commit> holds the binaries of the release at
# <commit>, stamped with its version from RELEASES.
$(CACHE_DIR)/release-%:
	@v=$$(awk -v c="$*" '$$2 == c { print $$1 }' RELEASES); \
		if [ -z "$$v" ]; then echo "no release at commit $* in RELEASES (docs/upgrading.md)"; exit 1; fi
	@mkdir -p $(CACHE_DIR)
	@$(call cache_lock,$@.lock) \
		v=$$(awk -v c="$*" '$$2 == c { print $$1 }' RELEASES); \
		git cat-file -e $*^{commit} 2>/dev/null || { echo "release $$v: commit $* is not in this repository's history (a shallow clone? git fetch --unshallow)"; exit 1; }; \
		echo "building release $$v ($*) into $@ (once per machine)"; \
		tmp=$$(mktemp -d $(CACHE_DIR)/.release-build.XXXXXX); \
		trap 'git worktree remove --force "$$tmp/src" >/dev/null 2>&1; rm -rf "$$tmp"; git worktree prune' EXIT; \
		git worktree add --quiet --detach "$$tmp/src" $*; \
		mkdir "$$tmp/bin"; \
		for s in $(UPGRADE_SERVICES); do \
			(cd "$$tmp/src/services/$$s" && $(GO) build -trimpath -tags "$(BUILD_TAGS)" \
				-ldflags "-X proxyfleet/pkg/buildinfo.Version=$$v" -o "$$tmp/bin/$$s" ./cmd/$$s); \
		done; \
		echo "$$v $*" >"$$tmp/bin/RELEASE"; \
		mv -T "$$tmp/bin" $@

.PHONY: prev-release
prev-release: $(PREV_BIN_DIR) ## build the previous release's binaries from the repository's history into the cache (once per machine)
	@echo $(PREV_BIN_DIR)

PREREQS += prev-release
PREREQ_TARGET_prev-release := prev-release
PREREQ_CHECK_prev-release  := test -e $(PREV_BIN_DIR)/RELEASE

# The current tree's binaries for the tier, stamped as make build stamps
# them (go's build cache makes this cheap when nothing changed).
UPGRADE_ENV = PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_PREV_BIN=$(PREV_BIN_DIR) \
	PROXYFLEET_PREV_VERSION=$(PREV_VERSION) PROXYFLEET_VERSION=$(VERSION) PROXYFLEET_BUILD_TAGS="$(BUILD_TAGS)"

.PHONY: test-upgrade
test-upgrade: $(NATSSERVER_BIN) $(PREV_BIN_DIR) ## the previous release's fleet upgraded to this tree service by service under gateway traffic: no failed request, no proxy recreated, views equal a rebuild
	cd e2e && $(UPGRADE_ENV) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags upgrade $(GOTEST_FLAGS) -v -timeout 15m -run 'TestUpgrade' .

TEST_ALL_TIERS += test-upgrade
TIER_NEEDS_test-upgrade := nats-server prev-release
# A lane of its own: it waits on processes and timers, and the test and
# kvm lanes are CI's longest already (mk/README).
TIER_LANE_test-upgrade := upgrade

# The golden event log (pkg/events/testdata/golden-0.1.0): the first release's
# binaries run a scenario through the API and its FLEET_EVENTS and final
# views are written as JSON. Run by hand, never by CI: the replay tests of
# make test read the committed files. GOLDEN_RELEASE must be the release
# the directory is named for.
GOLDEN_RELEASE ?= 0.1.0
GOLDEN_COMMIT   = $(shell awk '$$1 == "$(GOLDEN_RELEASE)" { print $$2 }' RELEASES)

.PHONY: golden-log
golden-log: $(NATSSERVER_BIN) ## regenerate pkg/events/testdata/golden-<GOLDEN_RELEASE> (0.1.0) with that release's binaries (by hand, not CI; docs/upgrading.md)
	@if [ -z "$(GOLDEN_COMMIT)" ]; then echo "golden-log: no release $(GOLDEN_RELEASE) in RELEASES"; exit 1; fi
	@$(MAKE) --no-print-directory $(CACHE_DIR)/release-$(GOLDEN_COMMIT)
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_PREV_BIN=$(CACHE_DIR)/release-$(GOLDEN_COMMIT) \
		PROXYFLEET_GOLDEN_WRITE=../pkg/events/testdata/golden-$(GOLDEN_RELEASE) \
		$(GO) test -tags upgrade -count=1 -v -timeout 10m -run 'TestGoldenLogWrite' .
