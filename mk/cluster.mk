# Cluster tier: a real three-node nats-server cluster (the pinned version,
# built into the cache by the nats-server target of mk/deploy.mk) on
# loopback, the whole system on it through --nats-url with every node's
# URL, and nodes killed, restarted and stopped under churn (e2e's
# cluster_test.go, docs/scaling.md). Then probes/s of one health replica
# and of two splitting the same 10,000 loopback proxies, measured in one
# run (BenchmarkProbeReplicas; x-one-replica is the ratio, min-share the
# share of the less busy replica).

.PHONY: test-cluster
test-cluster: $(NATSSERVER_BIN) ## the system on a 3-node nats-server cluster: R3, two planners and health replicas, nodes killed under churn; probes/s of 1 and 2 health replicas
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags cluster $(GOTEST_FLAGS) -v -timeout 15m -run 'TestCluster' .
	@echo "== probes/s with 1 and 2 health replicas (10,000 loopback proxies, one run)"
	@set -o pipefail; ulimit -n 20000 2>/dev/null || true; cd services/health && \
		$(GO) test -count=1 -run '^$$' -bench 'BenchmarkProbeReplicas' -benchtime 20000x ./internal/probe/ | grep -E '^(Benchmark|ok|FAIL)'

TEST_ALL_TIERS += test-cluster
TIER_NEEDS_test-cluster := nats-server
