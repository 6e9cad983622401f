# Busy-machine tier: `make test-stress` runs `make test` while CPU hogs keep
# every core busy, so tests that assume a prompt scheduler fail here rather
# than in CI. Not part of test-all: a loaded run takes several times as long.

STRESS_HOGS ?= $(shell nproc 2>/dev/null || echo 2)
STRESS_RUNS ?= 1

.PHONY: test-stress
test-stress: ## make test with every core kept busy by CPU hogs (STRESS_HOGS, STRESS_RUNS)
	@set -e; \
	hogs=""; \
	stop() { for p in $$hogs; do kill $$p 2>/dev/null || true; done; wait 2>/dev/null || true; }; \
	trap stop EXIT; \
	trap 'exit 130' INT; trap 'exit 143' TERM; \
	for i in $$(seq $(STRESS_HOGS)); do sh -c 'while :; do :; done' & hogs="$$hogs $$!"; done; \
	echo "== $(STRESS_HOGS) CPU hogs running (pids$$hogs)"; \
	for r in $$(seq $(STRESS_RUNS)); do \
		echo "== stress run $$r of $(STRESS_RUNS)"; \
		$(MAKE) --no-print-directory test; \
	done
