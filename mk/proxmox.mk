# Proxmox VE backend. Its tests need no root and no server: they run against
# a stateful fake of the Proxmox VE API, with contract tests that read the
# published API schema from ../shared/reference/proxmox/pve-api-schema.json
# (a missing schema fails here instead of skipping). `make test` runs them
# too; this target runs them alone.

.PHONY: test-proxmox
test-proxmox: ## proxmox-agent tests alone (fake Proxmox VE, contract tests against the API schema)
	cd services/proxmox-agent && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test $(GOTEST_FLAGS) ./...
