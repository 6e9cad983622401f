# Gateway tier: a real crawler through the crawler gateway. `make
# test-gateway-scrapy` installs Debian's Scrapy and has it crawl a local
# site of 200 pages through make run's gateway with HTTP_PROXY set. `make
# haproxy-install` installs the HAProxy the gateway's benchmarks compare it
# with.

SCRAPY ?= /usr/bin/scrapy

.PHONY: scrapy-install
scrapy-install: ## install Debian's Scrapy for the gateway tier (root)
	@if [ -x $(SCRAPY) ]; then echo "scrapy present: $$($(SCRAPY) version 2>/dev/null)"; exit 0; fi; \
	$(APT_INSTALL) python3-scrapy && $(SCRAPY) version

DEBIAN_PACKAGES += python3-scrapy

# HAProxy is a baseline of make bench: BenchmarkFrontEndVsHAProxy measures
# the gateway against it (and BenchmarkFrontEndVsSquid against Squid, which
# mk/local.mk installs). Without it that benchmark is skipped.
HAPROXY ?= /usr/sbin/haproxy

.PHONY: haproxy-install
haproxy-install: ## install Debian's haproxy, a baseline of make bench (root; no system haproxy is started)
	@if [ -x $(HAPROXY) ]; then echo "haproxy present: $$($(HAPROXY) -v | head -1)"; exit 0; fi; \
	$(APT_INSTALL) haproxy && $(HAPROXY) -v | head -1

DEBIAN_PACKAGES += haproxy

.PHONY: test-gateway-scrapy
test-gateway-scrapy: scrapy-install $(BIN)/nats ## Scrapy crawls a local site of 200 pages through make run's gateway (root; installs python3-scrapy)
	cd e2e && PROXYFLEET_SCRAPY=$(SCRAPY) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run TestGatewayScrapy ./...

TEST_ALL_TIERS += test-gateway-scrapy
TIER_NEEDS_test-gateway-scrapy := debian-packages nats-cli

# HTTPS tier: Scrapy (Debian) and Crawlee (npm, pinned by
# e2e/testdata/crawlee/package-lock.json) crawl a local HTTPS site through
# make run's gateway with interception, while the site bans one proxy's
# source address. Crawlee's modules are installed once per lock file into
# the cache (about 40 MB, 10-20 s); node and npm come from the machine, or
# from Debian's nodejs and npm packages when missing. Cost: about 1 min
# warm (make run, two crawls of 301 pages, a proxy replaced), about 1.5 min
# cold (Crawlee installed; nodejs and npm from Debian when missing: about
# 1 min more).
CRAWLEE_SRC  := e2e/testdata/crawlee
CRAWLEE_HASH := $(shell sha256sum $(CRAWLEE_SRC)/package-lock.json 2>/dev/null | cut -c1-12)
CRAWLEE_DIR  := $(CACHE_DIR)/crawlee-$(CRAWLEE_HASH)

.PHONY: crawlee-install
crawlee-install: ## install Crawlee (pinned) into the cache for the HTTPS gateway tier (root when node/npm are missing)
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then $(APT_INSTALL) nodejs npm; fi
	@if [ -e $(CRAWLEE_DIR)/.installed ]; then echo "crawlee present: $(CRAWLEE_DIR)"; exit 0; fi; \
	mkdir -p $(CACHE_DIR); tmp=$$(mktemp -d $(CACHE_DIR)/.crawlee.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	cp $(CRAWLEE_SRC)/package.json $(CRAWLEE_SRC)/package-lock.json "$$tmp"/ && \
	(cd "$$tmp" && npm ci --no-audit --no-fund --omit=optional --loglevel=error) && \
	touch "$$tmp/.installed" && rm -rf $(CRAWLEE_DIR) && mv "$$tmp" $(CRAWLEE_DIR) && echo "crawlee installed: $(CRAWLEE_DIR)"

PREREQS += crawlee
PREREQ_TARGET_crawlee := crawlee-install
PREREQ_CHECK_crawlee  := test -e $(CRAWLEE_DIR)/.installed

.PHONY: test-gateway-https
test-gateway-https: scrapy-install crawlee-install $(BIN)/nats ## Scrapy and Crawlee crawl a local HTTPS site through make run's intercepting gateway while the site bans a proxy (root; installs python3-scrapy, Crawlee)
	cd e2e && PROXYFLEET_SCRAPY=$(SCRAPY) PROXYFLEET_CRAWLEE_DIR=$(CRAWLEE_DIR) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run TestGatewayHTTPSCrawl ./...

TEST_ALL_TIERS += test-gateway-https
TIER_NEEDS_test-gateway-https := debian-packages nats-cli crawlee
