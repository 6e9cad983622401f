# kvm-agent tiers: a real libvirtd with QEMU (TCG), started for the run
# inside its own network namespace by services/kvm-agent/scripts/libvirt-tier.sh.

KVM_AGENT := services/kvm-agent

.PHONY: test-kvm
test-kvm: ## kvm-agent against a real libvirtd + QEMU in a network namespace (root; installs libvirt, QEMU, OVMF)
	@$(KVM_AGENT)/scripts/libvirt-tier.sh bash -c 'cd $(KVM_AGENT) && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test -race -tags integration -count=1 -timeout 12m -v ./integration/'

TEST_ALL_TIERS += test-kvm
TIER_NEEDS_test-kvm := debian-packages
# The kvm tiers take turns on one libvirtd (libvirt-tier.sh's lock) and
# spend their time in QEMU under TCG: in CI they run in a lane of their
# own, beside the others.
TIER_LANE_test-kvm := kvm

# What libvirt-tier.sh, build-guest.sh and build-cloud-image.sh install
# when missing (with recommended packages, as they do).
DEBIAN_PACKAGES_RECOMMENDS += libvirt-daemon-system qemu-system-x86 qemu-utils ovmf iproute2 tini \
	syslinux syslinux-common mtools dosfstools fdisk kmod cpio \
	mmdebstrap grub-common grub-efi-amd64-bin

# The boot test's guest disk, built from Debian packages by build-guest.sh
# into the cache (build-guest.sh keeps it while its recipe is unchanged),
# so fresh clones reuse it.
KVM_GUEST_DIR ?= $(CACHE_DIR)/kvm-guest

.PHONY: kvm-guest
kvm-guest: ## build the boot test's guest disk (busybox initramfs, Debian kernel) into ~/.cache/proxyfleet, once per recipe (root)
	@mkdir -p $(KVM_GUEST_DIR)
	@exec 9>$(KVM_GUEST_DIR).lock; flock 9; $(KVM_AGENT)/scripts/build-guest.sh $(KVM_GUEST_DIR)

PREREQS += guest-image
PREREQ_TARGET_guest-image := kvm-guest
PREREQ_CHECK_guest-image  := $(KVM_AGENT)/scripts/build-guest.sh $(KVM_GUEST_DIR) --check

.PHONY: e2e-kvm
e2e-kvm: kvm-guest ## boot a guest through the kvm-agent under TCG, get its address, HTTP through its proxy (root)
	@KVM_TEST_GUEST_IMAGE=$(KVM_GUEST_DIR)/guest.qcow2 KVM_TEST_GATEWAY=192.168.150.1 \
		$(KVM_AGENT)/scripts/libvirt-tier.sh bash -c 'cd $(KVM_AGENT) && ip netns exec "$$KVM_TEST_NETNS" env PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test -tags e2e,$(BUILD_TAGS) -count=1 -timeout 15m -run "TestGuestBootsAndProxies|TestDestroyedDomainIsReplaced" -v ./integration/'

TEST_ALL_TIERS += e2e-kvm
TIER_NEEDS_e2e-kvm := debian-packages guest-image
TIER_LANE_e2e-kvm  := kvm

.PHONY: bench-kvm
bench-kvm: ## kvm-agent numbers against a real libvirtd: upload throughput vs virsh vol-upload, create overhead, idle RSS (root)
	@$(KVM_AGENT)/scripts/libvirt-tier.sh bash -c 'cd $(KVM_AGENT) && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test -tags bench,$(BUILD_TAGS) -count=1 -timeout 10m -run TestBenchKVM -v ./integration/'

# The cloud-image tier's disk: Debian 12 with cloud-init, Squid,
# apache2-utils and qemu-guest-agent, UEFI-bootable, built from Debian
# packages by build-cloud-image.sh (about 9 minutes cold). It is kept in
# the cache outside the checkout (CACHE_DIR, as the nats CLI), named by the
# hash of the script, so it is rebuilt only when the recipe changes.
CLOUD_IMAGE_SCRIPT := $(KVM_AGENT)/scripts/build-cloud-image.sh
CLOUD_IMAGE := $(CACHE_DIR)/debian-12-cloud-$(shell sha256sum $(CLOUD_IMAGE_SCRIPT) 2>/dev/null | cut -c1-16).qcow2

$(CLOUD_IMAGE):
	@mkdir -p $(CACHE_DIR)
	@$(call cache_lock,$(CACHE_DIR)/.cloud-image.lock) \
	echo "building the Debian 12 cloud image into $@ (about 9 minutes cold)"; \
	$(CLOUD_IMAGE_SCRIPT) $@

.PHONY: cloud-image
cloud-image: $(CLOUD_IMAGE) ## build the Debian 12 cloud image (cloud-init, Squid, qemu-guest-agent, UEFI) into ~/.cache/proxyfleet, once per recipe (root)
	@echo "cloud image: $(CLOUD_IMAGE)"

PREREQS += cloud-image
PREREQ_TARGET_cloud-image := cloud-image
PREREQ_CHECK_cloud-image  := test -e $(CLOUD_IMAGE)

.PHONY: e2e-kvm-cloud
e2e-kvm-cloud: cloud-image ## proxies from the Debian cloud image through planner, health and the kvm-agent under TCG: default cloud-config with auth, operator cloud-config, shell user-data (root)
	@KVM_TEST_CLOUD_IMAGE=$(CLOUD_IMAGE) KVM_TEST_GATEWAY=192.168.150.1 \
		$(KVM_AGENT)/scripts/libvirt-tier.sh bash -c 'cd $(KVM_AGENT) && ip netns exec "$$KVM_TEST_NETNS" env PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test -tags e2e,$(BUILD_TAGS) -count=1 -timeout 25m -parallel 3 -run "TestCloudImageProxies" -v ./integration/'

TEST_ALL_TIERS += e2e-kvm-cloud
TIER_NEEDS_e2e-kvm-cloud := debian-packages cloud-image
TIER_LANE_e2e-kvm-cloud  := kvm
