# cloud-agent tiers. `make test` already runs the GCE tests (a stateful fake
# of the Compute API, contract-checked against the discovery document in
# google.golang.org/api); `make test-cloud` runs them alone. `make test-kube`
# runs the Kubernetes driver against a real kube-apiserver and etcd, both
# kept in a cache outside the checkout so every clone on a machine reuses
# them: kube-apiserver is built from source, together with the kubelet and
# kube-scheduler of the node tier (mk/kubenode.mk), by the module in
# services/cloud-agent/tools/kube; etcd is Debian's etcd-server package
# unpacked without installing it.
# It also runs the Squid of the Pods the driver builds (their config,
# htpasswd line, user and read-only root) with Debian's squid, which
# squid-install (mk/local.mk) provides.

CLOUD_AGENT  := services/cloud-agent
KUBE_VERSION := v1.34.2
KUBE_CACHE   ?= $(if $(XDG_CACHE_HOME),$(XDG_CACHE_HOME),$(HOME)/.cache)/proxyfleet
KUBE_MODULE  := $(CLOUD_AGENT)/tools/kube

# The three Kubernetes binaries come from one go build of one module: the
# packages they share (most of k8s.io, at one set of versions) are compiled
# once and linked three times, and -s -w spares the linker the symbol and
# DWARF tables (its largest cost on binaries this size). The version is
# stamped as a release build would (otherwise v0.0.0-master). No file of
# k8s.io/kubernetes at this version carries the providerless tag, so it
# would change nothing. KUBE_BINS is named by the version;
# the stamp file in it by the hash of the recipe (the module and the flags),
# so a change of either rebuilds them.
KUBE_VERSION_LDFLAGS := -X k8s.io/component-base/version.gitVersion=$(KUBE_VERSION) \
	-X k8s.io/component-base/version.gitMajor=$(word 2,$(subst ., ,$(subst v,v ,$(KUBE_VERSION)))) \
	-X k8s.io/component-base/version.gitMinor=$(word 3,$(subst ., ,$(subst v,v ,$(KUBE_VERSION)))) \
	-X k8s.io/component-base/version.gitTreeState=clean
# They are compiled without optimisation or inlining (-N -l): the tiers
# run them for minutes, and the compile is the larger cost, a quarter less
# CPU without the optimiser (measured on the planner's cold build: 125 CPU
# seconds instead of 169). No DWARF either, which -w would discard.
KUBE_BUILD_FLAGS := -trimpath -gcflags 'all=-N -l -dwarf=false' -ldflags '-s -w $(KUBE_VERSION_LDFLAGS)'
KUBE_RECIPE := $(shell { cat $(KUBE_MODULE)/go.mod $(KUBE_MODULE)/go.sum; echo "$(KUBE_BUILD_FLAGS)"; } 2>/dev/null | sha256sum | cut -c1-16)
KUBE_BINS   := $(KUBE_CACHE)/kube-$(KUBE_VERSION)
KUBE_STAMP  := $(KUBE_BINS)/recipe-$(KUBE_RECIPE)
KUBE_APISERVER_BIN := $(KUBE_BINS)/kube-apiserver
KUBELET_BIN        := $(KUBE_BINS)/kubelet
KUBE_SCHEDULER_BIN := $(KUBE_BINS)/kube-scheduler
KUBE_ETCD_BIN      := $(KUBE_CACHE)/etcd-root/usr/bin/etcd

$(KUBE_STAMP):
	@mkdir -p $(KUBE_CACHE)
	@$(call cache_lock,$(KUBE_CACHE)/.kube.lock) \
	echo "building kube-apiserver, kubelet and kube-scheduler $(KUBE_VERSION) into $(KUBE_BINS) (one go build; about 12 minutes on a cold module cache)"; \
	tmp=$$(mktemp -d $(KUBE_CACHE)/.kube-build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	(cd $(KUBE_MODULE) && GOWORK=off $(GO) build $(KUBE_BUILD_FLAGS) -o "$$tmp"/ \
		k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler); \
	rm -rf $(KUBE_BINS); mkdir -p $(KUBE_BINS); \
	mv -f "$$tmp"/kube-apiserver "$$tmp"/kubelet "$$tmp"/kube-scheduler $(KUBE_BINS)/; \
	touch $@

.PHONY: kube-bins
kube-bins: $(KUBE_STAMP) ## build kube-apiserver, kubelet and kube-scheduler (one go build) into ~/.cache/proxyfleet

PREREQS += kube-binaries
PREREQ_TARGET_kube-binaries := kube-bins
PREREQ_CHECK_kube-binaries  := test -e $(KUBE_STAMP)

$(KUBE_ETCD_BIN):
	@mkdir -p $(KUBE_CACHE)
	@$(call cache_lock,$(KUBE_CACHE)/.etcd.lock) \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(APT_INSTALL) --lists; cd "$$tmp" && apt-get download etcd-server; \
	rm -rf $(KUBE_CACHE)/etcd-root && dpkg -x "$$tmp"/etcd-server_*.deb $(KUBE_CACHE)/etcd-root; \
	$@ --version | head -1

.PHONY: etcd
etcd: $(KUBE_ETCD_BIN) ## unpack Debian's etcd-server into ~/.cache/proxyfleet for the kube tiers

PREREQS += etcd
PREREQ_TARGET_etcd := etcd
PREREQ_CHECK_etcd  := test -x $(KUBE_ETCD_BIN)

.PHONY: kube-control-plane
kube-control-plane: $(KUBE_STAMP) $(KUBE_ETCD_BIN) ## build/fetch kube-apiserver and etcd for test-kube into ~/.cache/proxyfleet

.PHONY: test-cloud
test-cloud: ## cloud-agent GCE tests alone (stateful Compute fake, discovery contract, NATS end to end)
	cd $(CLOUD_AGENT) && $(GO) test $(GOTEST_FLAGS) ./internal/gce/ ./internal/config/ ./cmd/...

.PHONY: test-kube
test-kube: kube-control-plane squid-install ## cloud-agent Kubernetes driver against a real kube-apiserver + etcd (builds them once), and its Squid Pod's config under real Squid (root)
	cd $(CLOUD_AGENT) && KUBE_APISERVER=$(KUBE_APISERVER_BIN) ETCD=$(KUBE_ETCD_BIN) PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags integration $(GOTEST_FLAGS) ./internal/kube/

TEST_ALL_TIERS += test-kube
TIER_NEEDS_test-kube := kube-binaries etcd debian-packages

.PHONY: test-cloud-e2e
test-cloud-e2e: ## a pool of 2 on a GCE entry through planner, health and the cloud-agent binary (Compute fake)
	cd $(CLOUD_AGENT) && $(GO) test -tags e2e $(GOTEST_FLAGS) -run TestSystem ./internal/gce/

TEST_ALL_TIERS += test-cloud-e2e
