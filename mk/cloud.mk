# cloud-agent tiers. `make test` already runs the GCE tests (a stateful fake
# of the Compute API, contract-checked against the discovery document in
# google.golang.org/api); `make test-cloud` runs them alone. `make test-kube`
# runs the Kubernetes driver against a real kube-apiserver and etcd, both
# kept in a cache outside the checkout so every clone on a machine reuses
# them: kube-apiserver is built from source by the small module in
# services/cloud-agent/tools/kube-apiserver (about 12 minutes cold), etcd is
# Debian's etcd-server package unpacked without installing it.
# It also runs the Squid of the Pods the driver builds (their config,
# htpasswd line, user and read-only root) with Debian's squid, which
# squid-install (mk/local.mk) provides.

CLOUD_AGENT  := services/cloud-agent
KUBE_VERSION := v1.34.2
KUBE_CACHE   ?= $(if $(XDG_CACHE_HOME),$(XDG_CACHE_HOME),$(HOME)/.cache)/proxyfleet
KUBE_APISERVER_BIN := $(KUBE_CACHE)/kube-apiserver-$(KUBE_VERSION)
KUBE_ETCD_BIN      := $(KUBE_CACHE)/etcd-root/usr/bin/etcd

$(KUBE_APISERVER_BIN):
	@mkdir -p $(KUBE_CACHE)
	@echo "building kube-apiserver $(KUBE_VERSION) into $(KUBE_CACHE) (about 12 minutes on a cold module cache)"
	cd $(CLOUD_AGENT)/tools/kube-apiserver && GOWORK=off $(GO) build -trimpath -o $@.tmp k8s.io/kubernetes/cmd/kube-apiserver
	@mv -f $@.tmp $@

$(KUBE_ETCD_BIN):
	@mkdir -p $(KUBE_CACHE)
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get -o DPkg::Lock::Timeout=600 update -q; \
	cd "$$tmp" && apt-get download etcd-server; \
	rm -rf $(KUBE_CACHE)/etcd-root && dpkg -x "$$tmp"/etcd-server_*.deb $(KUBE_CACHE)/etcd-root; \
	$@ --version | head -1

.PHONY: kube-control-plane
kube-control-plane: $(KUBE_APISERVER_BIN) $(KUBE_ETCD_BIN) ## build/fetch kube-apiserver and etcd for test-kube into ~/.cache/proxyfleet

.PHONY: test-cloud
test-cloud: ## cloud-agent GCE tests alone (stateful Compute fake, discovery contract, NATS end to end)
	cd $(CLOUD_AGENT) && $(GO) test $(GOTEST_FLAGS) ./internal/gce/ ./internal/config/ ./cmd/...

.PHONY: test-kube
test-kube: kube-control-plane squid-install ## cloud-agent Kubernetes driver against a real kube-apiserver + etcd (builds them once), and its Squid Pod's config under real Squid (root)
	cd $(CLOUD_AGENT) && KUBE_APISERVER=$(KUBE_APISERVER_BIN) ETCD=$(KUBE_ETCD_BIN) PROXYFLEET_SQUID=$(SQUID) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags integration $(GOTEST_FLAGS) ./internal/kube/

TEST_ALL_TIERS += test-kube

.PHONY: test-cloud-e2e
test-cloud-e2e: ## a pool of 2 on a GCE entry through planner, health and the cloud-agent binary (Compute fake)
	cd $(CLOUD_AGENT) && $(GO) test -tags e2e $(GOTEST_FLAGS) -run TestSystem ./internal/gce/

TEST_ALL_TIERS += test-cloud-e2e
