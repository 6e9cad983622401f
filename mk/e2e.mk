# End-to-end tier with real Squid: the whole system (planner, health,
# local-agent) as processes, every proxy a Squid from Debian's package.

.PHONY: test-e2e-squid
test-e2e-squid: squid-install ## the pool flow end to end with real Squid proxies (root; installs squid)
	cd e2e && PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run 'Squid' ./...

TEST_ALL_TIERS += test-e2e-squid
TIER_NEEDS_test-e2e-squid := debian-packages
