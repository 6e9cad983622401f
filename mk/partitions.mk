# Partition tier (docs/scaling.md, docs/operator-guide.md "A partitioned
# node"): the cluster tier's three nats-server nodes each in a network
# namespace of their own, with a planner, a health replica and a local
# agent per node, joined by a bridge the test creates on a private /24
# that never leaves the machine. The network is cut by iptables (a minority
# node, the leader planner's node, one direction between two nodes) and
# made lossy (tc netem's 200 ms and 5% where the kernel has netem, else 5%
# loss by iptables alone), each fault healed after 25 s, while API calls go
# to any reachable node. After each fault the cluster tier's invariants
# hold; at the end the views equal a rebuild and a history check passes
# (every acknowledged call in the log exactly once, every decision fenced
# by its replica's term). It prints each fault's unavailability of the API
# and of new decisions. Needs root (ip netns); it builds with the cluster
# tag too, whose helpers it reuses.

.PHONY: test-partitions
test-partitions: $(NATSSERVER_BIN) ## the 3-node cluster in network namespaces, partitioned by iptables/netem under API calls: invariants, history check, unavailability per fault
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags 'cluster partitions' $(GOTEST_FLAGS) -v -timeout 15m -run 'TestPartitions' .

# Not in test-all yet: its first CI run failed (the settled size was
# overwritten by a load request a partitioned planner answered after the
# heal, which the test took for a lost write); it joins test-all once it
# passes there repeatedly.
DEBIAN_PACKAGES += iproute2 iptables
TIER_NEEDS_test-partitions := nats-server debian-packages
# It waits on timers and fault windows, not the CPU: beside test-upgrade
# in that short lane, not in the main one (mk/README).
TIER_LANE_test-partitions := upgrade
