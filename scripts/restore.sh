#!/usr/bin/env bash
# Restores a backup written by scripts/backup.sh into a fresh NATS server
# (docs/backup.md): every stream with its durable consumers, through the
# pinned nats CLI.
#
#   scripts/restore.sh [--replicas N] BACKUP_DIR
#
# The connection and the identity are the nats CLI's (NATS_URL, NATS_NKEY
# or NATS_CREDS or NATS_USER/NATS_PASSWORD, NATS_CA); under deploy/nats the
# identity is admin. NATS_CLI names the CLI (default: ./bin/nats, then nats
# on PATH). --replicas sets every stream's replicas (a cluster's backup
# into one server: --replicas 1); by default each keeps its own.
#
# It refuses, changing nothing, when the server already holds any of the
# backup's streams: restore only into a server whose JetStream store is
# empty, before any service (or planner bootstrap) has run against it.
# Afterwards it checks that FLEET_EVENTS ends at the recovery point. The
# services are then started as usual, health's views rebuilt first
# (docs/operator-guide.md, "Restore").
set -euo pipefail

usage() {
	echo "usage: $0 [--replicas N] BACKUP_DIR   (NATS_URL and the nats CLI's credentials from the environment)" >&2
	exit 2
}

replicas=""
while [ $# -gt 0 ]; do
	case $1 in
	--replicas)
		[ $# -ge 2 ] || usage
		replicas=$2
		shift 2
		;;
	-h | --help) usage ;;
	-*) echo "restore: unknown flag $1" >&2; usage ;;
	*) break ;;
	esac
done
[ $# -eq 1 ] || usage
src=${1%/}
if [ -n "$replicas" ] && ! [[ $replicas =~ ^[1-5]$ ]]; then
	echo "restore: --replicas: want 1 to 5, got \"$replicas\"" >&2
	exit 2
fi

cli=${NATS_CLI:-}
if [ -z "$cli" ]; then
	if [ -x "$(dirname "$0")/../bin/nats" ]; then cli=$(dirname "$0")/../bin/nats; else cli=nats; fi
fi
command -v "$cli" >/dev/null || { echo "restore: no nats CLI at $cli: run make nats, or set NATS_CLI" >&2; exit 1; }
command -v jq >/dev/null || { echo "restore: jq is needed to read the backup's metadata (apt-get install jq)" >&2; exit 1; }

rp=$src/recovery-point.json
if [ ! -f "$rp" ]; then
	echo "restore: $rp is missing: $src is not a complete backup of scripts/backup.sh (nothing was changed)" >&2
	exit 1
fi
mapfile -t streams < <(jq -r '.streams[]' "$rp")
want_seq=$(jq -r .lastSeq "$rp")
echo "restore: recovery point: $(jq -r '"FLEET_EVENTS sequence \(.lastSeq) at \(.lastTime) (backup finished \(.finished))"' "$rp")"

# Every stream's backup must be whole before the server is touched.
for s in "${streams[@]}"; do
	if [ ! -f "$src/$s/backup.json" ]; then
		echo "restore: $src/$s/backup.json is missing: the backup is incomplete (nothing was changed)" >&2
		exit 1
	fi
	"$cli" backup validate --no-progress "$src/$s" >/dev/null ||
		{ echo "restore: the backup of stream $s does not validate (nothing was changed)" >&2; exit 1; }
done

have=$("$cli" stream ls --names) || { echo "restore: cannot list the server's streams (NATS_URL, credentials?) (nothing was changed)" >&2; exit 1; }
clash=()
for s in "${streams[@]}"; do
	if grep -qxF "$s" <<<"$have"; then clash+=("$s"); fi
done
if [ ${#clash[@]} -gt 0 ]; then
	echo "restore: the server already holds ${clash[*]}: restore only into a fresh server (an empty JetStream store, no service or planner bootstrap run against it yet); nothing was changed" >&2
	exit 1
fi

for s in "${streams[@]}"; do
	args=(--no-progress)
	if [ -n "$replicas" ]; then args+=(--replicas "$replicas"); fi
	if ! out=$("$cli" backup restore stream "${args[@]}" "$src/$s" 2>&1); then
		echo "$out" >&2
		echo "restore: stream $s failed; the streams restored so far stay: remove them (or the store) before trying again" >&2
		exit 1
	fi
	echo "restore: $s"
done

got_seq=$("$cli" stream info FLEET_EVENTS --json | jq -r .state.last_seq)
if [ "$got_seq" != "$want_seq" ]; then
	echo "restore: FLEET_EVENTS ends at sequence $got_seq after the restore, the backup's at $want_seq" >&2
	exit 1
fi
echo "restore: ${#streams[@]} streams restored; FLEET_EVENTS ends at sequence $got_seq"
if [ -f "$src/keys.tar" ]; then
	echo "restore: the keys are in $src/keys.tar (tar -tf lists them): put back those that were lost with their hosts"
fi
echo "restore: next: health --rebuild-views, then start the services (docs/operator-guide.md, Restore)"
