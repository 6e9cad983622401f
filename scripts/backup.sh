#!/usr/bin/env bash
# Backs up the whole control state of a running fleet (docs/backup.md):
# every JetStream stream of the account — FLEET_EVENTS, FLEET_CMDS, the
# gateways' request log, every KV_* bucket and the OBJ_* object store —
# with its durable consumers, through the pinned nats CLI's stream
# snapshots, and, with --keys, the keys that live outside NATS.
#
#   scripts/backup.sh [--keys PATH]... BACKUP_DIR
#
# --keys (repeatable) adds a file or directory to keys.tar under its base
# name: the make deploy-secrets directory (nkeys, accounts.conf, TLS),
# health's probe.xk and the gateway's gateway.xk (the gateway CA's key in
# fleet-gateway-ca is sealed to it), the agents' key directories.
#
# The connection and the identity are the nats CLI's: NATS_URL and
# NATS_NKEY (or NATS_CREDS, NATS_USER/NATS_PASSWORD), NATS_CA for TLS, and
# NATS_INBOX_PREFIX, the identity's reply prefix (the CLI's --inbox-prefix).
# The identity must take stream snapshots: under deploy/nats that is backup
# (NATS_NKEY=backup.nk NATS_INBOX_PREFIX=_INBOX_backup), which can read
# every stream and change nothing; admin may too.
# NATS_CLI names the CLI (default: ./bin/nats, then nats on PATH).
#
# BACKUP_DIR must not exist; it is written as BACKUP_DIR.partial and
# renamed when complete, so a directory under its own name is a whole
# backup. It holds one directory per stream (backup.json, stream.arc.s2),
# recovery-point.json and, with --keys, keys.tar; it is readable by its
# owner only: it holds the pools' secrets.
#
# The recovery point is FLEET_EVENTS' last sequence and its time in the
# backup: events appended after it are lost by a restore. The object store
# (the planner's snapshots, a cache of the log) is backed up before
# FLEET_EVENTS, so none covers events the backup lacks; the buckets and
# the other streams after it, so the pools' secrets cover every pool the
# log names.
set -euo pipefail

usage() {
	echo "usage: $0 [--keys PATH]... BACKUP_DIR   (NATS_URL and the nats CLI's credentials from the environment)" >&2
	exit 2
}

keys=()
while [ $# -gt 0 ]; do
	case $1 in
	--keys)
		[ $# -ge 2 ] || usage
		keys+=("$2")
		shift 2
		;;
	-h | --help) usage ;;
	-*) echo "backup: unknown flag $1" >&2; usage ;;
	*) break ;;
	esac
done
[ $# -eq 1 ] || usage
dest=${1%/}

cli=${NATS_CLI:-}
if [ -z "$cli" ]; then
	if [ -x "$(dirname "$0")/../bin/nats" ]; then cli=$(dirname "$0")/../bin/nats; else cli=nats; fi
fi
command -v "$cli" >/dev/null || { echo "backup: no nats CLI at $cli: run make nats, or set NATS_CLI" >&2; exit 1; }
cliargs=()
if [ -n "${NATS_INBOX_PREFIX:-}" ]; then
	cliargs+=(--inbox-prefix "$NATS_INBOX_PREFIX")
fi
command -v jq >/dev/null || { echo "backup: jq is needed to read the backup's metadata (apt-get install jq)" >&2; exit 1; }

if [ -e "$dest" ]; then
	echo "backup: $dest exists: give a new directory (nothing was written)" >&2
	exit 1
fi
tarargs=()
for k in "${keys[@]}"; do
	if [ ! -e "$k" ]; then
		echo "backup: --keys: $k does not exist (nothing was written)" >&2
		exit 1
	fi
	k=$(cd "$(dirname "$k")" && pwd)/$(basename "$k")
	tarargs+=(-C "$(dirname "$k")" "$(basename "$k")")
done

streams=$("$cli" "${cliargs[@]}" stream ls --names) || { echo "backup: cannot list the streams (NATS_URL, credentials?)" >&2; exit 1; }
if ! grep -qx FLEET_EVENTS <<<"$streams"; then
	echo "backup: the server has no stream FLEET_EVENTS: not a proxyfleet server, or the wrong account (nothing was written)" >&2
	exit 1
fi
# The order: object stores, FLEET_EVENTS, then everything else.
ordered=$(grep '^OBJ_' <<<"$streams" || true; echo FLEET_EVENTS; grep -v -e '^OBJ_' -e '^FLEET_EVENTS$' <<<"$streams" || true)

partial=$dest.partial
rm -rf "$partial"
mkdir -p "$(dirname "$dest")"
(umask 077 && mkdir "$partial")
trap 'rm -rf "$partial"' EXIT

started=$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)
n=0
for s in $ordered; do
	[ -n "$s" ] || continue
	if ! out=$("$cli" "${cliargs[@]}" backup stream --consumers --no-progress "$s" "$partial/$s" 2>&1); then
		echo "$out" >&2
		echo "backup: stream $s failed (nothing kept)" >&2
		exit 1
	fi
	n=$((n + 1))
done
finished=$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)

if [ ${#keys[@]} -gt 0 ]; then
	(umask 077 && tar -cf "$partial/keys.tar" "${tarargs[@]}")
fi

jq -n --slurpfile ev "$partial/FLEET_EVENTS/backup.json" \
	--arg started "$started" --arg finished "$finished" --arg keys "$([ ${#keys[@]} -gt 0 ] && echo keys.tar)" \
	--argjson streams "$(printf '%s\n' $ordered | jq -R . | jq -s .)" \
	'{stream: "FLEET_EVENTS", lastSeq: $ev[0].state.last_seq, lastTime: $ev[0].state.last_ts,
	  started: $started, finished: $finished, streams: $streams, keys: $keys}' >"$partial/recovery-point.json"

mv "$partial" "$dest"
trap - EXIT
rp=$(jq -r '"FLEET_EVENTS sequence \(.lastSeq) at \(.lastTime)"' "$dest/recovery-point.json")
echo "backup: $n streams in $dest$([ ${#keys[@]} -gt 0 ] && echo " and the keys in $dest/keys.tar")"
echo "backup: recovery point: $rp"
