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
