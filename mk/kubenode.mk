# The Kubernetes node tier. `make test-kube-node` runs a pool on the
# `kubernetes` entry against a real node: the kube-apiserver and etcd of
# `make test-kube` (mk/cloud.mk), a kube-scheduler, and a kubelet with
# containerd, runc and the bridge CNI (Debian packages) in a network
# namespace of its own. The Pods run a Squid image built here from Debian
# packages and imported into containerd, so no registry is involved
# (docs/kubernetes.md#the-node-tier).
#
# kubelet and kube-scheduler are built from source with kube-apiserver, in
# one go build of the module in services/cloud-agent/tools/kube, into the
# same cache (kube-bins in mk/cloud.mk). The images (Squid from a minimal
# Debian rootfs, and a pause image from services/cloud-agent/tools/pause)
# are cached there too, keyed by a hash of their recipe.

KUBE_NODE_PACKAGES := containerd runc containernetworking-plugins mmdebstrap iproute2 util-linux

.PHONY: kube-node-install
kube-node-install: ## install containerd, runc, the CNI plugins and mmdebstrap for test-kube-node (root; starts no service)
	@if command -v containerd runc mmdebstrap nsenter >/dev/null && [ -x /usr/lib/cni/bridge ]; then \
		echo "node packages present: $$(containerd --version | cut -d' ' -f3), runc $$(runc --version | awk 'NR==1{print $$3}')"; exit 0; fi; \
	$(APT_INSTALL) $(KUBE_NODE_PACKAGES)

DEBIAN_PACKAGES += $(KUBE_NODE_PACKAGES)

KUBE_NODE_IMAGES := $(KUBE_CACHE)/kube-node-images

.PHONY: kube-node-images
kube-node-images: kube-node-install ## build the Squid and pause images of test-kube-node (OCI layout, cached by recipe hash)
	$(CLOUD_AGENT)/scripts/kube-node-images.sh $(KUBE_NODE_IMAGES)

PREREQS += kube-node-images
PREREQ_TARGET_kube-node-images := kube-node-images
PREREQ_CHECK_kube-node-images  := $(CLOUD_AGENT)/scripts/kube-node-images.sh $(KUBE_NODE_IMAGES) --check

.PHONY: test-kube-node
test-kube-node: kube-control-plane kube-node-images ## a pool on a kubernetes entry on a real kubelet + containerd node, through its Squid Pods (root)
	@set -e; env=$$($(CLOUD_AGENT)/scripts/kube-node-images.sh $(KUBE_NODE_IMAGES) | tail -1); \
	cd $(CLOUD_AGENT) && KUBE_APISERVER=$(KUBE_APISERVER_BIN) ETCD=$(KUBE_ETCD_BIN) KUBELET=$(KUBELET_BIN) KUBE_SCHEDULER=$(KUBE_SCHEDULER_BIN) \
		PROXYFLEET_REQUIRE_INTEGRATION=1 ./scripts/kube-node-tier.sh "$$env" -- \
		$(GO) test -tags integration,kubenode $(GOTEST_FLAGS) -v -run '^TestNodePoolOnRealKubelet$$' ./internal/kube/

TEST_ALL_TIERS += test-kube-node
TIER_NEEDS_test-kube-node := kube-binaries etcd debian-packages kube-node-images
