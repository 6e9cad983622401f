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
KUBE_NODE_PACKAGES := containerd runc containernetworking-plugins mmdebstrap iproute2

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
