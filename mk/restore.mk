# Backup and restore (docs/backup.md). `make backup DIR=... [KEYS="..."]` and
# `make restore DIR=... [REPLICAS=N]` run scripts/backup.sh and
# scripts/restore.sh with the pinned nats CLI; the connection and identity
# come from the environment as for the nats CLI (NATS_URL, NATS_NKEY or
# NATS_CREDS, NATS_CA, NATS_INBOX_PREFIX; under deploy/nats the backup
# identity backs up and admin restores).
#
# `make test-restore` runs e2e's restore_test.go: a real nats-server with
# file storage and the services as processes, backed up while a pool
# serves, changed after the backup, its store removed, restored into a
# fresh server with the scripts, and the services started again: they adopt
# the running proxies, clean up what the backup does not know, rebuild the
# views and serve again. It prints the recovery point and the recovery time.

.PHONY: backup
backup: $(BIN)/nats ## back up every stream, bucket and object store of a running fleet into DIR, with KEYS="paths" (deploy secrets, probe.xk, gateway.xk) (docs/backup.md)
	@if [ -z "$(DIR)" ]; then echo "usage: make backup DIR=<new directory> [KEYS=\"<deploy secrets dir> <probe.xk> <gateway.xk> ...\"]"; exit 2; fi
	@NATS_CLI=$(BIN)/nats ./scripts/backup.sh $(foreach k,$(KEYS),--keys "$(k)") "$(DIR)"

.PHONY: restore
restore: $(BIN)/nats ## restore the backup in DIR into a fresh NATS server ([REPLICAS=N]; docs/backup.md)
	@if [ -z "$(DIR)" ]; then echo "usage: make restore DIR=<backup directory> [REPLICAS=N]"; exit 2; fi
	@NATS_CLI=$(BIN)/nats ./scripts/restore.sh $(if $(REPLICAS),--replicas "$(REPLICAS)") "$(DIR)"

.PHONY: test-restore
test-restore: $(NATSSERVER_BIN) $(NATSCLI_BIN) ## back up a serving fleet, lose the server's disk, restore into a fresh one: proxies adopted, orphans cleaned, views rebuilt; recovery point and time
	cd e2e && PROXYFLEET_NATS_SERVER=$(NATSSERVER_BIN) PROXYFLEET_NATS_CLI=$(NATSCLI_BIN) PROXYFLEET_REQUIRE_INTEGRATION=1 \
		$(GO) test -tags restore $(GOTEST_FLAGS) -v -timeout 10m -run 'TestRestore' .

TEST_ALL_TIERS += test-restore
# The scripts read the backups' JSON metadata with jq.
DEBIAN_PACKAGES += jq
TIER_NEEDS_test-restore := nats-server nats-cli debian-packages
