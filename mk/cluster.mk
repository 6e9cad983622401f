# Cluster tier: a real three-node nats-server cluster (the pinned version,
# built into the cache by the nats-server target of mk/deploy.mk) on
# loopback, the whole system on it through --nats-url with every node's
# URL, and nodes killed, restarted and stopped under churn (e2e's
# cluster_test.go, docs/scaling.md). Then probes/s of one health replica
# and of two splitting the same 10,000 loopback proxies, measured in one
# run (BenchmarkProbeReplicas; x-one-replica is the ratio, min-share the
# share of the less busy replica). A failed run prints its whole output and
# is measured once more: a probe lost to a machine shared with other lanes
# fails the figure, not the tier, unless it happens twice.

.PHONY: test-cluster
test-cluster: $(NATSSERVER_BIN) ## the system on a 3-node nats-server cluster: R3, two planners and health replicas, nodes killed under churn; probes/s of 1 and 2 health replicas
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags cluster $(GOTEST_FLAGS) -v -timeout 15m -run 'TestCluster' .
	@echo "== probes/s with 1 and 2 health replicas (10,000 loopback proxies, one run)"
	@ulimit -n 20000 2>/dev/null || true; cd services/health && out=$$(mktemp) && \
	for try in 1 2; do \
		if $(GO) test -tags "$(BUILD_TAGS)" -count=1 -run '^$$' -bench 'BenchmarkProbeReplicas' -benchtime 20000x ./internal/probe/ >"$$out" 2>&1; then \
			grep -E '^(Benchmark|ok)' "$$out"; rm -f "$$out"; exit 0; \
		fi; \
		echo "== the probes/s benchmark failed (run $$try of 2); its whole output:"; cat "$$out"; \
	done; rm -f "$$out"; exit 1

TEST_ALL_TIERS += test-cluster
TIER_NEEDS_test-cluster := nats-server
