# Gateway tier: a real crawler through the crawler gateway. `make
# test-gateway-scrapy` installs Debian's Scrapy and has it crawl a local
# site of 200 pages through make run's gateway with HTTP_PROXY set.

SCRAPY ?= /usr/bin/scrapy

.PHONY: scrapy-install
scrapy-install: ## install Debian's Scrapy for the gateway tier (root)
	@if [ -x $(SCRAPY) ]; then echo "scrapy present: $$($(SCRAPY) version 2>/dev/null)"; exit 0; fi; \
	$(APT_INSTALL) python3-scrapy && $(SCRAPY) version

DEBIAN_PACKAGES += python3-scrapy

.PHONY: test-gateway-scrapy
test-gateway-scrapy: scrapy-install $(BIN)/nats ## Scrapy crawls a local site of 200 pages through make run's gateway (root; installs python3-scrapy)
	cd e2e && PROXYFLEET_SCRAPY=$(SCRAPY) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run TestGatewayScrapy ./...

TEST_ALL_TIERS += test-gateway-scrapy
TIER_NEEDS_test-gateway-scrapy := debian-packages nats-cli
