# kvm-agent tiers: a real libvirtd with QEMU (TCG), started for the run
# inside its own network namespace by services/kvm-agent/scripts/libvirt-tier.sh.

KVM_AGENT := services/kvm-agent

.PHONY: test-kvm
test-kvm: ## kvm-agent against a real libvirtd + QEMU in a network namespace (root; installs libvirt, QEMU, OVMF)
	@$(KVM_AGENT)/scripts/libvirt-tier.sh bash -c 'cd $(KVM_AGENT) && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test -tags integration -count=1 -timeout 12m -v ./integration/'

TEST_ALL_TIERS += test-kvm
