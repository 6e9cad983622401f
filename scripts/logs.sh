#!/usr/bin/env bash
# Shows the last warnings and errors of make run: for each service log in
# <run-dir>/logs and each proxy log of the local-agent
# (<run-dir>/local-agent/proxies/px-…/proxy.log), the last LOG_LINES (5) lines
# at level WARN or ERROR, and for proxy logs also any line that is not JSON
# (Squid's own output). A request a proxy failed (502 proxy: origin
# unreachable) has its cause here.
#
#   scripts/logs.sh [run-dir]     (make logs; run-dir defaults to
#                                  $PROXYFLEET_RUN_DIR or .run)
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${1:-${PROXYFLEET_RUN_DIR:-.run}}
LOG_LINES=${LOG_LINES:-5}
STATE="$RUN/local-agent/proxies"

if [ ! -d "$RUN/logs" ]; then
	echo "no logs in $RUN/logs: make run has not run here (or set PROXYFLEET_RUN_DIR)" >&2
	exit 1
fi

# json_field FILE KEY prints the first scalar value of KEY in FILE (the
# agent writes its state with encoding/json: one key per line).
json_field() {
	sed -n 's/^ *"'"$2"'": *"\{0,1\}\([^",]*\)"\{0,1\},\{0,1\}$/\1/p' "$1" | head -n 1
}

# show TITLE FILE PATTERN prints the last $LOG_LINES lines of FILE matching
# PATTERN under TITLE, or that there are none.
show() {
	local found
	found=$(grep -E "$3" "$2" | tail -n "$LOG_LINES" || true)
	if [ -z "$found" ]; then
		echo "== $1: no warnings or errors"
	else
		echo "== $1 ($2):"
		printf '%s\n' "$found" | sed 's/^/  /'
	fi
}

problems='"level":"(WARN|ERROR)"'
for f in "$RUN"/logs/*.log; do
	[ -f "$f" ] || continue
	show "$(basename "$f" .log)" "$f" "$problems"
done

n=0
for f in "$STATE"/*/proxy.log; do
	[ -f "$f" ] || continue
	n=$((n + 1))
	dir=$(dirname "$f")
	name=$(basename "$dir")
	title="proxy instance $name"
	if [ -f "$STATE/$name.json" ]; then
		title="proxy $(json_field "$STATE/$name.json" proxyID) of pool $(json_field "$STATE/$name.json" pool) (instance $name)"
	fi
	show "$title" "$f" "$problems|^[^{]"
done
[ "$n" -gt 0 ] || echo "== no proxy logs in $STATE"
