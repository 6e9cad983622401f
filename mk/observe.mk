# Observability: make observe runs a real Prometheus (Debian's package) and
# a real Jaeger v2 next to make run (scripts/observe.sh); the tiers check
# deploy/prometheus with promtool and deploy/otel with a core collector
# build (docs/observability.md).

PROMETHEUS ?= /usr/bin/prometheus
PROMTOOL   ?= /usr/bin/promtool

# Jaeger v2 (the OpenTelemetry-collector-based jaeger binary), built once
# per machine into the cache like the nats CLI; ./bin/jaeger links to it.
JAEGER_VERSION := v1.76.0
JAEGER_BIN     := $(CACHE_DIR)/jaeger-$(JAEGER_VERSION)
# `go install …@version` refuses a module whose go.mod replaces modules, so
# it is built in a module of its own that repeats jaeger's one replace.
JAEGER_REPLACE := github.com/Shopify/sarama=github.com/Shopify/sarama@v1.33.0

# The core collector distribution's components at one release, built once
# per machine from deploy/otel/otelcorecol (a main and a go.mod) into the
# cache, named by the hash of that recipe.
OTELCOL_DIR := deploy/otel/otelcorecol
OTELCOL_BIN := $(CACHE_DIR)/otelcorecol-$(shell cat $(OTELCOL_DIR)/go.mod $(OTELCOL_DIR)/go.sum $(OTELCOL_DIR)/main.go 2>/dev/null | sha256sum | cut -c1-16)

.PHONY: prometheus-install
prometheus-install: ## install Debian's prometheus and promtool (root; no system prometheus is started)
	@if [ -x $(PROMETHEUS) ] && [ -x $(PROMTOOL) ]; then echo "prometheus present: $$($(PROMETHEUS) --version 2>&1 | head -1)"; exit 0; fi; \
	set -e; \
	backup=""; \
	if [ -e /usr/sbin/policy-rc.d ]; then backup=$$(mktemp /usr/sbin/policy-rc.d.pf.XXXXXX); cp -p /usr/sbin/policy-rc.d "$$backup"; fi; \
	restore() { if [ -n "$$backup" ]; then mv -f "$$backup" /usr/sbin/policy-rc.d; else rm -f /usr/sbin/policy-rc.d; fi; }; \
	trap restore EXIT; \
	printf '#!/bin/sh\n# installed by make prometheus-install: keep package scripts from starting services\nexit 101\n' > /usr/sbin/policy-rc.d; \
	chmod 755 /usr/sbin/policy-rc.d; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get -o DPkg::Lock::Timeout=600 update -q; \
	apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends prometheus; \
	if command -v systemctl >/dev/null && systemctl is-enabled prometheus >/dev/null 2>&1; then \
		systemctl disable --now prometheus >/dev/null 2>&1 || true; \
	fi; \
	$(PROMETHEUS) --version 2>&1 | head -1

$(JAEGER_BIN):
	@mkdir -p $(CACHE_DIR)
	@echo "building jaeger $(JAEGER_VERSION) (v2) into $(CACHE_DIR) (once per machine; minutes)"
	@set -e; tmp=$$(mktemp -d $(CACHE_DIR)/.jaeger-build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
		cd "$$tmp"; export GOWORK=off GOFLAGS=-mod=mod; \
		$(GO) mod init proxyfleet.invalid/jaeger-build >/dev/null 2>&1; \
		$(GO) mod edit -replace $(JAEGER_REPLACE); \
		$(GO) get github.com/jaegertracing/jaeger@$(JAEGER_VERSION); \
		$(GO) build -trimpath -o jaeger github.com/jaegertracing/jaeger/cmd/jaeger; \
		mv -f jaeger $@

$(BIN)/jaeger: $(JAEGER_BIN)
	@mkdir -p $(BIN)
	@ln -sfn $(JAEGER_BIN) $@

.PHONY: jaeger
jaeger: $(BIN)/jaeger ## link Jaeger v2 into ./bin/jaeger (built once into ~/.cache/proxyfleet)

.PHONY: observe
observe: prometheus-install $(BIN)/jaeger ## next to make run: Prometheus on :9090 scraping its services, Jaeger v2 on :16686 (OTLP :4317/:4318); Ctrl-C stops both
	@./scripts/observe.sh

# e2e/observe_test.go's TestObserve is skipped by make test; this tier
# installs Prometheus, builds Jaeger and runs it inside a network namespace
# of its own (unshare --net, loopback only), where make observe's default
# ports are free by construction. The test binary and the services are
# built before entering it.
.PHONY: test-observe
test-observe: prometheus-install $(BIN)/jaeger $(BIN)/nats ## make observe next to make run: a pool of 3 in Prometheus, its trace in Jaeger (root; installs prometheus, builds jaeger; runs in a network namespace)
	cd e2e && $(GO) test -c -o $(BIN)/e2e-observe.test .
	cd e2e && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test $(GOTEST_FLAGS) -run 'TestRunBannerMetrics' .
	cd e2e && unshare --net sh -c 'ip link set lo up && PROXYFLEET_OBSERVE=netns PROXYFLEET_REQUIRE_INTEGRATION=1 $(BIN)/e2e-observe.test -test.run "^TestObserve$$" -test.count 1 -test.v'

TEST_ALL_TIERS += test-observe

.PHONY: test-prometheus-rules
test-prometheus-rules: prometheus-install ## promtool: check deploy/prometheus's config and rules, run the rules' unit tests (root; installs prometheus)
	$(PROMTOOL) check config deploy/prometheus/prometheus.yml
	$(PROMTOOL) check rules deploy/prometheus/rules/recording.yml deploy/prometheus/rules/alerts.yml
	cd deploy/prometheus/rules && $(PROMTOOL) test rules *_test.yml

TEST_ALL_TIERS += test-prometheus-rules

$(OTELCOL_BIN): $(OTELCOL_DIR)/go.mod $(OTELCOL_DIR)/go.sum $(OTELCOL_DIR)/main.go
	@mkdir -p $(CACHE_DIR)
	@echo "building the core OpenTelemetry Collector components into $(CACHE_DIR) (once per recipe; minutes)"
	@set -e; tmp=$$(mktemp $(CACHE_DIR)/.otelcorecol.XXXXXX); trap 'rm -f "$$tmp"' EXIT; \
		cd $(OTELCOL_DIR) && GOWORK=off $(GO) build -trimpath -o "$$tmp" . && mv -f "$$tmp" $@

.PHONY: otelcol
otelcol: $(OTELCOL_BIN) ## build the core collector of deploy/otel/otelcorecol into ~/.cache/proxyfleet

.PHONY: test-otel-config
test-otel-config: $(OTELCOL_BIN) ## validate deploy/otel/collector.yaml with a real core collector build (built once)
	$(OTELCOL_BIN) validate --config deploy/otel/collector.yaml

TEST_ALL_TIERS += test-otel-config

# make pictures remakes the images of docs/observability.md from a real
# run (scripts/pictures.sh): make run with traces, make observe, a pool with
# traffic through the gateway, headless Chromium (Debian's chromium).
.PHONY: pictures
pictures: prometheus-install $(BIN)/jaeger $(addprefix build-,$(RUN_SERVICES)) $(BIN)/nats ## the images of docs/observability.md from a real run (needs chromium; about 4 minutes)
	@command -v chromium >/dev/null || { echo "chromium is missing: apt-get install chromium" >&2; exit 1; }
	@./scripts/pictures.sh docs/img
