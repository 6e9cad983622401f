# Long runs (docs/soak.md): the services as processes under churn — a pool
# scaled up and down, proxies recycled and killed with kill -9, health and
# a planner restarted — and gateway traffic at a steady rate, sampled for
# every service's RSS, goroutines and open files and every stream's and
# bucket's size. It fails on growth beyond the documented bounds, on a
# request failing beyond its retries outside a fault's window, or on an
# error line no injected fault explains.
#
#   make soak SOAK=30m [SOAK_SAMPLE=30s] [SOAK_STEP=15s] [SOAK_RATE=5] [SOAK_OUT=dir]
#
# writes SOAK_OUT/soak.json, soak.csv and soak.png. make soak-pictures
# draws docs/img/soak-*.png from SOAK_OUT. make test-soak is the same run
# for 3 minutes, sampled every 10 s, in make test-all.

SOAK        ?= 30m
SOAK_SAMPLE ?= 30s
SOAK_STEP   ?= 15s
SOAK_RATE   ?= 5
SOAK_OUT    ?= $(CURDIR)/.run/soak

SOAK_ENV = PROXYFLEET_REQUIRE_INTEGRATION=1 PROXYFLEET_SOAK=$(SOAK) PROXYFLEET_SOAK_SAMPLE=$(SOAK_SAMPLE) \
	PROXYFLEET_SOAK_STEP=$(SOAK_STEP) PROXYFLEET_SOAK_RATE=$(SOAK_RATE) PROXYFLEET_SOAK_OUT=$(SOAK_OUT)

# SOAK_TIMEOUT is go test's -timeout (last, so it wins over GOTEST_FLAGS'):
# the run's length and 30 minutes to settle and check; raise it with SOAK.
SOAK_TIMEOUT ?= 2h

.PHONY: soak
soak: ## the long run: churn and gateway traffic for SOAK (30m), sampled every SOAK_SAMPLE (30s); fails on growth beyond docs/soak.md's bounds; writes SOAK_OUT's soak.json, soak.csv, soak.png
	@mkdir -p $(SOAK_OUT)
	cd e2e && $(SOAK_ENV) $(GO) test -tags soak $(GOTEST_FLAGS) -timeout $(SOAK_TIMEOUT) -v -run 'TestSoak$$' .
	cd e2e && $(GO) run ./internal/soakplot -in $(SOAK_OUT)/soak.json -out $(SOAK_OUT)/soak.png

.PHONY: soak-pictures
soak-pictures: ## docs/img/soak-run.png and its samples (soak-run.json) from the last make soak (SOAK_OUT)
	cp $(SOAK_OUT)/soak.json docs/img/soak-run.json
	cd e2e && $(GO) run ./internal/soakplot -in $(CURDIR)/docs/img/soak-run.json -out $(CURDIR)/docs/img/soak-run.png

# make test-all's run: 3 minutes, sampled every 10 s, a churn step every
# 10 s (two cycles and more of the eight steps), on the embedded JetStream
# server of every e2e test: no prerequisite to build.
.PHONY: test-soak
test-soak: ## the long run for 3 minutes (make soak's test, sampled every 10 s): no growth beyond docs/soak.md's bounds, no unexplained error
	cd e2e && $(SOAK_ENV) PROXYFLEET_SOAK=3m PROXYFLEET_SOAK_SAMPLE=10s PROXYFLEET_SOAK_STEP=10s PROXYFLEET_SOAK_OUT=$(SOAK_OUT)-3m \
		$(GO) test -tags soak $(GOTEST_FLAGS) -timeout 15m -v -run 'TestSoak' .

TEST_ALL_TIERS += test-soak
TIER_NEEDS_test-soak :=
# The upgrade lane: it waits on processes and timers too, and that lane
# ends long before the test lane (mk/README).
TIER_LANE_test-soak := upgrade
