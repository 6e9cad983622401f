# Console tier (docs/console.md): headless Chromium from Debian, driven
# from Go over the DevTools protocol (e2e/internal/browser), against the
# console and the services it shows, each a real process: pages that update
# live, actions behind confirmation and CSRF, a viewer refused, a pool of
# 10,000 proxies on the instant backend, and axe-core (npm, pinned by
# e2e/testdata/axe/package-lock.json) on every page. The browser reaches
# loopback only (a guard proxy refuses and records the rest).
#
# axe-core is installed once per lock file into the cache (one package,
# about 3 MB); node and npm come from the machine, or from Debian's nodejs
# and npm packages when missing.

CHROMIUM ?= /usr/bin/chromium
AXE_SRC  := e2e/testdata/axe
AXE_HASH := $(shell sha256sum $(AXE_SRC)/package-lock.json 2>/dev/null | cut -c1-12)
AXE_DIR  := $(CACHE_DIR)/axe-$(AXE_HASH)
AXE_JS   := $(AXE_DIR)/node_modules/axe-core/axe.min.js

.PHONY: chromium-install
chromium-install: ## install Debian's chromium for the console tier and make pictures (root)
	@if [ -x $(CHROMIUM) ]; then echo "chromium present: $$($(CHROMIUM) --version 2>/dev/null)"; exit 0; fi; \
	$(APT_INSTALL) chromium && $(CHROMIUM) --version 2>/dev/null

DEBIAN_PACKAGES += chromium

$(AXE_DIR)/.installed:
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then $(APT_INSTALL) nodejs npm; fi
	@mkdir -p $(CACHE_DIR)
	@$(call cache_lock,$(CACHE_DIR)/.axe.lock) \
	tmp=$$(mktemp -d $(CACHE_DIR)/.axe.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	cp $(AXE_SRC)/package.json $(AXE_SRC)/package-lock.json "$$tmp"/; \
	(cd "$$tmp" && npm ci --no-audit --no-fund --loglevel=error); \
	test -s "$$tmp/node_modules/axe-core/axe.min.js"; \
	touch "$$tmp/.installed"; rm -rf $(AXE_DIR); mv "$$tmp" $(AXE_DIR); echo "axe-core installed: $(AXE_DIR)"

.PHONY: axe-install
axe-install: $(AXE_DIR)/.installed ## install axe-core (pinned) into the cache for the console tier (root when node/npm are missing)

PREREQS += axe
PREREQ_TARGET_axe := axe-install
PREREQ_CHECK_axe  := test -e $(AXE_DIR)/.installed

# The browser harness's own tests (a loopback page under the console's
# Content-Security-Policy, the guard, axe-core finding what it should),
# then the console's. PROXYFLEET_REQUIRE_INTEGRATION=1: a missing chromium
# or axe-core fails them instead of skipping. No -race: the 10,000-proxy
# pool's JetStream server runs embedded in the test process, which the
# race detector would slow several-fold, and the tests' own code is a
# browser driver (the services' races are make test's).
CONSOLE_TESTS ?= ^TestConsole
CONSOLE_GOTEST_FLAGS ?= -count=1 -timeout 30m

.PHONY: test-console
test-console: chromium-install axe-install ## the console in headless Chromium: live pages, actions, roles, CSRF, 10,000 proxies, axe-core (root; installs chromium, axe-core)
	cd e2e && PROXYFLEET_CHROMIUM=$(CHROMIUM) PROXYFLEET_AXE=$(AXE_JS) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags console,$(BUILD_TAGS) $(CONSOLE_GOTEST_FLAGS) -v -run '^TestBrowser' ./internal/browser/
	cd e2e && PROXYFLEET_CHROMIUM=$(CHROMIUM) PROXYFLEET_AXE=$(AXE_JS) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags console,$(BUILD_TAGS) $(CONSOLE_GOTEST_FLAGS) -v -run '$(CONSOLE_TESTS)' .

TEST_ALL_TIERS += test-console
TIER_NEEDS_test-console := debian-packages axe
# The upgrade lane: the one with the most slack (mk/README).
TIER_LANE_test-console := upgrade
