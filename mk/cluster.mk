# Cluster tier: a real three-node nats-server cluster (the pinned version,
# built into the cache by the nats-server target of mk/deploy.mk) on
# loopback, the whole system on it through --nats-url with every node's
# URL, and nodes killed, restarted and stopped under churn (e2e's
# cluster_test.go, docs/scaling.md).

.PHONY: test-cluster
test-cluster: $(NATSSERVER_BIN) ## the system on a 3-node nats-server cluster: R3, two planners and health replicas, nodes killed under churn
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags cluster $(GOTEST_FLAGS) -v -timeout 15m -run 'TestCluster' .

TEST_ALL_TIERS += test-cluster
