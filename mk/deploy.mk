# Deployment credentials and the deploy tier (docs/deploy.md).
#
# `make deploy-secrets DIR=... [AGENTS="local/t1 kvm/host1"] [GATEWAYS="gw-1 gw-2"] [HOSTS=...]`
# writes one nkey seed per identity (gateway-<name> per gateway), nkeys.env
# (the public keys deploy/nats reads), accounts.conf (the server's users,
# each gateway with permissions naming only its own subjects) and a CA
# with server and client certificates, using Go's crypto (no openssl).
#
# `make test-deploy` builds the pinned nats-server (the version pkg/go.mod
# embeds) once into the cache directory, then runs e2e's deploy test: the
# shipped deploy/nats and deploy/systemd files against that real server
# over TLS.

# NATSSERVER_BIN is defined in the Makefile, before the mk/*.mk files that
# name it as a prerequisite (cluster.mk is read before this file).

DEPLOY_AGENTS ?= local/t1
DEPLOY_GATEWAYS ?= gw-1
DEPLOY_HOSTS  ?= localhost,127.0.0.1,::1

$(NATSSERVER_BIN):
	@mkdir -p $(CACHE_DIR)
	@$(call cache_lock,$@.lock) \
		echo "building nats-server $(NATSSERVER_VERSION) into $(CACHE_DIR) (once per machine)"; \
		tmp=$$(mktemp -d $(CACHE_DIR)/.nats-server-build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
		GOBIN="$$tmp" $(GO) install github.com/nats-io/nats-server/v2@$(NATSSERVER_VERSION); \
		mv -f "$$tmp/nats-server" $@

.PHONY: nats-server
nats-server: $(NATSSERVER_BIN) ## build the pinned nats-server into the cache (for deploy/nats and make test-deploy)
	@echo $(NATSSERVER_BIN)

PREREQS += nats-server
PREREQ_TARGET_nats-server := nats-server
PREREQ_CHECK_nats-server  := test -x $(NATSSERVER_BIN)

.PHONY: deploy-secrets
deploy-secrets: ## nkeys, nkeys.env, accounts.conf and TLS certificates for deploy/nats: DIR=... [AGENTS="local/t1 kvm/host1"] [GATEWAYS="gw-1 gw-2"] [HOSTS=nats.example,10.0.0.5]
	@if [ -z "$(DIR)" ]; then echo "usage: make deploy-secrets DIR=<new directory> [AGENTS=\"local/t1 ...\"] [GATEWAYS=\"gw-1 ...\"] [HOSTS=host,ip,...]"; exit 2; fi
	@cd pkg && $(GO) run ./deploykeys/cmd/deploy-secrets -dir "$(abspath $(DIR))" -agents "$(or $(AGENTS),$(DEPLOY_AGENTS))" -gateways "$(or $(GATEWAYS),$(DEPLOY_GATEWAYS))" -hosts "$(or $(HOSTS),$(DEPLOY_HOSTS))"

.PHONY: test-deploy
test-deploy: $(NATSSERVER_BIN) $(NATSCLI_BIN) ## the shipped deploy/nats and systemd units against a real nats-server over TLS: lifecycle and every refusal
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_NATS_CLI=$(NATSCLI_BIN) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags deploy $(GOTEST_FLAGS) -run 'TestDeploy' ./...

TEST_ALL_TIERS += test-deploy
TIER_NEEDS_test-deploy := nats-server nats-cli
