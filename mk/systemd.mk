# systemd tier: every unit in deploy/systemd is scored by `systemd-analyze
# security --offline=yes` and must stay at or below 3.0 (kvm-agent's level).
# `make test` runs the same test and skips it where systemd-analyze is
# missing; this tier installs it and refuses to skip.

.PHONY: test-systemd
test-systemd: ## score the systemd units with systemd-analyze security (installs Debian's systemd when missing)
	@command -v systemd-analyze >/dev/null || $(APT_INSTALL) systemd
	cd e2e && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test $(GOTEST_FLAGS) -run 'TestSystemdUnitsHardened' .

TEST_ALL_TIERS += test-systemd
TIER_NEEDS_test-systemd := debian-packages
DEBIAN_PACKAGES += systemd
