# Observability: make observe runs a real Prometheus (Debian's package) and
# a real Jaeger v2 next to make run (scripts/observe.sh); the tiers check
# deploy/prometheus with promtool and deploy/otel with a core collector
# build (docs/observability.md).

PROMETHEUS ?= /usr/bin/prometheus
PROMTOOL   ?= /usr/bin/promtool

# Jaeger v2 (the OpenTelemetry-collector-based jaeger binary, v1.76.0) and
# the core collector of deploy/otel/otelcorecol are pinned by one module,
# deploy/otel (its go.mod repeats jaeger's one replace), and built by one
# go build into the cache, named by the hash of that recipe: the collector
# packages both are made of (at Jaeger's collector release) are compiled
# once, and -s -w spares the linker the DWARF of two large binaries.
# ./bin/jaeger links to the cached jaeger.
OTEL_MODULE := deploy/otel
# Without optimisation or inlining (-N -l), like the Kubernetes binaries
# (mk/cloud.mk): the tiers send them a few traces and validate one config,
# and the compile is a quarter cheaper. The flags are part of the recipe.
OTEL_BUILD_FLAGS := -trimpath -gcflags 'all=-N -l -dwarf=false' -ldflags '-s -w'
OTEL_RECIPE := $(shell { cat $(OTEL_MODULE)/go.mod $(OTEL_MODULE)/go.sum $(OTEL_MODULE)/otelcorecol/main.go; echo "$(OTEL_BUILD_FLAGS)"; } 2>/dev/null | sha256sum | cut -c1-16)
OTEL_BINS   := $(CACHE_DIR)/otel-$(OTEL_RECIPE)
JAEGER_BIN  := $(OTEL_BINS)/jaeger
OTELCOL_BIN := $(OTEL_BINS)/otelcorecol

$(OTEL_BINS)/.built:
	@mkdir -p $(CACHE_DIR)
	@$(call cache_lock,$(CACHE_DIR)/.otel.lock) \
	echo "building jaeger (v2) and the core OpenTelemetry Collector into $(OTEL_BINS) (one go build, once per recipe; minutes)"; \
	tmp=$$(mktemp -d $(CACHE_DIR)/.otel-build.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
	(cd $(OTEL_MODULE) && GOWORK=off $(GO) build $(OTEL_BUILD_FLAGS) -o "$$tmp"/ \
		./otelcorecol github.com/jaegertracing/jaeger/cmd/jaeger); \
	rm -rf $(OTEL_BINS); mv "$$tmp" $(OTEL_BINS); touch $@

$(JAEGER_BIN) $(OTELCOL_BIN): $(OTEL_BINS)/.built

PREREQS += otel
PREREQ_TARGET_otel := otelcol
PREREQ_CHECK_otel  := test -e $(OTEL_BINS)/.built

.PHONY: prometheus-install
prometheus-install: ## install Debian's prometheus and promtool (root; no system prometheus is started)
	@if [ -x $(PROMETHEUS) ] && [ -x $(PROMTOOL) ]; then echo "prometheus present: $$($(PROMETHEUS) --version 2>&1 | head -1)"; exit 0; fi; \
	set -e; $(APT_INSTALL) prometheus; \
	if command -v systemctl >/dev/null && systemctl is-enabled prometheus >/dev/null 2>&1; then \
		systemctl disable --now prometheus >/dev/null 2>&1 || true; \
	fi; \
	$(PROMETHEUS) --version 2>&1 | head -1

DEBIAN_PACKAGES += prometheus

$(BIN)/jaeger: $(JAEGER_BIN)
	@mkdir -p $(BIN)
	@ln -sfn $(JAEGER_BIN) $@

.PHONY: jaeger
jaeger: $(BIN)/jaeger ## link Jaeger v2 into ./bin/jaeger (built once, with the core collector, into ~/.cache/proxyfleet)

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
	cd e2e && $(GO) test -tags "$(BUILD_TAGS)" -c -o $(BIN)/e2e-observe.test .
	cd e2e && PROXYFLEET_REQUIRE_INTEGRATION=1 $(GO) test $(GOTEST_FLAGS) -run 'TestRunBannerMetrics' .
	cd e2e && unshare --net sh -c 'ip link set lo up && PROXYFLEET_OBSERVE=netns PROXYFLEET_REQUIRE_INTEGRATION=1 $(BIN)/e2e-observe.test -test.run "^TestObserve$$" -test.count 1 -test.v'

TEST_ALL_TIERS += test-observe
TIER_NEEDS_test-observe := debian-packages otel nats-cli

.PHONY: test-prometheus-rules
test-prometheus-rules: prometheus-install ## promtool: check deploy/prometheus's config and rules, run the rules' unit tests (root; installs prometheus)
	$(PROMTOOL) check config deploy/prometheus/prometheus.yml
	$(PROMTOOL) check rules deploy/prometheus/rules/recording.yml deploy/prometheus/rules/alerts.yml
	cd deploy/prometheus/rules && $(PROMTOOL) test rules *_test.yml

TEST_ALL_TIERS += test-prometheus-rules
TIER_NEEDS_test-prometheus-rules := debian-packages

.PHONY: otelcol
otelcol: $(OTELCOL_BIN) ## build the core collector of deploy/otel/otelcorecol (with jaeger) into ~/.cache/proxyfleet

.PHONY: test-otel-config
test-otel-config: $(OTELCOL_BIN) ## validate deploy/otel/collector.yaml with a real core collector build (built once)
	$(OTELCOL_BIN) validate --config deploy/otel/collector.yaml

TEST_ALL_TIERS += test-otel-config
TIER_NEEDS_test-otel-config := otel

# make pictures remakes the images of docs/observability.md and
# docs/console.md from a real run (scripts/pictures.sh): make run with
# traces, make observe, a pool with traffic through the gateway, headless
# Chromium (Debian's chromium, mk/console.mk).
.PHONY: pictures
pictures: prometheus-install chromium-install $(BIN)/jaeger $(addprefix build-,$(RUN_SERVICES)) $(BIN)/nats ## the images of docs/observability.md and docs/console.md from a real run (about 5 minutes)
	@./scripts/pictures.sh docs/img
