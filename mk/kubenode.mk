# The Kubernetes node tier. `make test-kube-node` runs a pool on the
# `kubernetes` entry against a real node: the kube-apiserver and etcd of
# `make test-kube` (mk/cloud.mk), a kube-scheduler, and a kubelet with
# containerd, runc and the bridge CNI (Debian packages) in a network
# namespace of its own. The Pods run a Squid image built here from Debian
# packages and imported into containerd, so no registry is involved
# (docs/kubernetes.md#the-node-tier).
#
# kubelet and kube-scheduler are built from source by the module in
# services/cloud-agent/tools/kube-node at KUBE_VERSION, into the same cache
# as kube-apiserver (about 30 minutes cold on two loaded cores). The images
# (Squid from a minimal Debian rootfs, and a pause image from
# services/cloud-agent/tools/pause) are cached there too, keyed by a hash
# of their recipe.

KUBE_NODE_BINS    := $(KUBE_CACHE)/kube-node-$(KUBE_VERSION)
KUBELET_BIN       := $(KUBE_NODE_BINS)/kubelet
KUBE_SCHEDULER_BIN := $(KUBE_NODE_BINS)/kube-scheduler
KUBE_NODE_PACKAGES := containerd runc containernetworking-plugins mmdebstrap iproute2 util-linux

# The version the binaries report (otherwise v0.0.0-master).
KUBE_VERSION_LDFLAGS := -X k8s.io/component-base/version.gitVersion=$(KUBE_VERSION) \
	-X k8s.io/component-base/version.gitMajor=$(word 2,$(subst ., ,$(subst v,v ,$(KUBE_VERSION)))) \
	-X k8s.io/component-base/version.gitMinor=$(word 3,$(subst ., ,$(subst v,v ,$(KUBE_VERSION)))) \
	-X k8s.io/component-base/version.gitTreeState=clean

$(KUBELET_BIN):
	@mkdir -p $(KUBE_NODE_BINS)
	@echo "building kubelet and kube-scheduler $(KUBE_VERSION) into $(KUBE_NODE_BINS) (about 30 minutes on a cold module cache)"
	@set -e; tmp=$$(mktemp -d $(KUBE_CACHE)/.kube-node-build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
		cd $(CLOUD_AGENT)/tools/kube-node && GOWORK=off $(GO) build -trimpath -ldflags '$(KUBE_VERSION_LDFLAGS)' -o "$$tmp"/ \
			k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler; \
		mv -f "$$tmp"/kube-scheduler $(KUBE_SCHEDULER_BIN); mv -f "$$tmp"/kubelet $(KUBELET_BIN)

.PHONY: kube-node-bins
kube-node-bins: $(KUBELET_BIN) ## build kubelet and kube-scheduler for test-kube-node into ~/.cache/proxyfleet

# Debian's containerd package would start a system containerd where systemd
# runs; policy-rc.d keeps it stopped (the tier runs its own).
.PHONY: kube-node-install
kube-node-install: ## install containerd, runc, the CNI plugins and mmdebstrap for test-kube-node (root; starts no service)
	@if command -v containerd runc mmdebstrap nsenter >/dev/null && [ -x /usr/lib/cni/bridge ]; then \
		echo "node packages present: $$(containerd --version | cut -d' ' -f3), runc $$(runc --version | awk 'NR==1{print $$3}')"; exit 0; fi; \
	set -e; \
	backup=""; \
	if [ -e /usr/sbin/policy-rc.d ]; then backup=$$(mktemp /usr/sbin/policy-rc.d.pf.XXXXXX); cp -p /usr/sbin/policy-rc.d "$$backup"; fi; \
	restore() { if [ -n "$$backup" ]; then mv -f "$$backup" /usr/sbin/policy-rc.d; else rm -f /usr/sbin/policy-rc.d; fi; }; \
	trap restore EXIT; \
	printf '#!/bin/sh\n# installed by make kube-node-install: keep package scripts from starting services\nexit 101\n' > /usr/sbin/policy-rc.d; \
	chmod 755 /usr/sbin/policy-rc.d; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get -o DPkg::Lock::Timeout=600 update -q; \
	apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends $(KUBE_NODE_PACKAGES)

KUBE_NODE_IMAGES := $(KUBE_CACHE)/kube-node-images

.PHONY: kube-node-images
kube-node-images: kube-node-install ## build the Squid and pause images of test-kube-node (OCI layout, cached by recipe hash)
	$(CLOUD_AGENT)/scripts/kube-node-images.sh $(KUBE_NODE_IMAGES)

.PHONY: test-kube-node
test-kube-node: kube-control-plane kube-node-bins kube-node-images ## a pool on a kubernetes entry on a real kubelet + containerd node, through its Squid Pods (root)
	@set -e; env=$$($(CLOUD_AGENT)/scripts/kube-node-images.sh $(KUBE_NODE_IMAGES) | tail -1); \
	cd $(CLOUD_AGENT) && KUBE_APISERVER=$(KUBE_APISERVER_BIN) ETCD=$(KUBE_ETCD_BIN) KUBELET=$(KUBELET_BIN) KUBE_SCHEDULER=$(KUBE_SCHEDULER_BIN) \
		PROXYFLEET_REQUIRE_INTEGRATION=1 ./scripts/kube-node-tier.sh "$$env" -- \
		$(GO) test -tags integration,kubenode $(GOTEST_FLAGS) -v -run '^TestNodePoolOnRealKubelet$$' ./internal/kube/

TEST_ALL_TIERS += test-kube-node
