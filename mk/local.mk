# Local backend: the Squid tier. `make test-squid` installs Debian's squid
# (without letting the package start a system squid on port 3128) and
# apache2-utils (htpasswd), and runs the local-agent tests that drive real
# Squid processes, the egress policy through real Squid (root: it creates a
# network namespace), `squid -k parse` of every squid.conf proxyfleet writes,
# and the pkg/htpasswd tests against basic_ncsa_auth and htpasswd.

SQUID ?= /usr/sbin/squid

.PHONY: squid-install
squid-install: ## install Debian's squid and htpasswd for the local backend (root; no system squid is started)
	@if [ -x $(SQUID) ] && command -v htpasswd >/dev/null; then echo "squid present: $$($(SQUID) -v | head -1)"; exit 0; fi; \
	$(APT_INSTALL) squid apache2-utils && $(SQUID) -v | head -1

DEBIAN_PACKAGES += squid apache2-utils

.PHONY: test-squid
test-squid: squid-install ## local backend with real Squid processes (root; installs squid)
	cd services/local-agent && PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run Squid ./...
	cd pkg && PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run Squid ./cloudinit/
	cd services/cloud-agent && PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test $(GOTEST_FLAGS) -run Squid ./internal/kube/
	cd pkg && PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags integration $(GOTEST_FLAGS) ./htpasswd/

TEST_ALL_TIERS += test-squid
TIER_NEEDS_test-squid := debian-packages
