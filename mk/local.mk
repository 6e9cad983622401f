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
	set -e; \
	backup=""; \
	if [ -e /usr/sbin/policy-rc.d ]; then backup=$$(mktemp /usr/sbin/policy-rc.d.pf.XXXXXX); cp -p /usr/sbin/policy-rc.d "$$backup"; fi; \
	restore() { if [ -n "$$backup" ]; then mv -f "$$backup" /usr/sbin/policy-rc.d; else rm -f /usr/sbin/policy-rc.d; fi; }; \
	trap restore EXIT; \
	printf '#!/bin/sh\n# installed by make squid-install: keep package scripts from starting services\nexit 101\n' > /usr/sbin/policy-rc.d; \
	chmod 755 /usr/sbin/policy-rc.d; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get -o DPkg::Lock::Timeout=600 update -q; \
	apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends squid apache2-utils; \
	$(SQUID) -v | head -1

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
