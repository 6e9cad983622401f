#!/usr/bin/env bash
# The whole of CI (.ci/run): lint, tidy-check, `make test` module by module
# and every tier of `make test-all`, with the cached prerequisites the tiers
# need (Debian packages, Go modules, kube binaries, images, Jaeger, ...)
# built meanwhile by a second make at the lowest CPU priority, so they use
# the cycles the tests leave idle instead of running after them.
#
# The tiers run in the order `make ci-plan` lists them, except that one
# whose prerequisites are still being built gives way to the next one that
# is ready. A prerequisite a tier needs is built once: every cached build
# holds a lock, and a tier that reaches one still building waits for it.
# Ends with a table of every step's seconds and of where each prerequisite
# came from (the cache, or built by this run).
#
# Knobs: CI_STATE (a directory for the builder's log and marks; a new one
# in /tmp by default), CI_PREREQ_NICE (19).
set -uo pipefail
cd "$(dirname "$0")/.."

STATE=${CI_STATE:-$(mktemp -d /tmp/proxyfleet-ci.XXXXXX)}
mkdir -p "$STATE/done" "$STATE/failed"
: >"$STATE/steps.tsv" >"$STATE/prereqs.tsv"
T0=$(date +%s)
builder=""

# The plan: tiers and what each needs, prerequisites and their targets.
plan=$(make -s --no-print-directory ci-plan) || { echo "ci: make ci-plan failed" >&2; exit 1; }
declare -A needs=() target=() origin=()
tiers=() prereqs=()
while read -r kind name rest; do
	case $kind in
	tier) tiers+=("$name"); needs[$name]=$rest ;;
	prereq) prereqs+=("$name"); target[$name]=$rest ;;
	esac
done <<<"$plan"

# What the cache holds before anything runs.
for p in "${prereqs[@]}"; do
	if make -s --no-print-directory "prereq-cached-$p" >/dev/null 2>&1; then
		origin[$p]=cached
		touch "$STATE/done/$p"
	else
		origin[$p]=built
	fi
done
gocache=$(go env GOCACHE)
if [ -n "$(ls -A "$gocache" 2>/dev/null)" ]; then gocache_origin=cached; else gocache_origin=empty; fi

# The builder: Debian packages and Go modules first (the network, while
# lint and the first tests use the CPU), then the builds in the order the
# tiers want them. Each mark lands in $STATE/done or $STATE/failed.
order=(debian-packages go-modules nats-cli nats-server guest-image kube-binaries etcd cloud-image kube-node-images otel)
for p in "${prereqs[@]}"; do
	case " ${order[*]} " in *" $p "*) ;; *) order+=("$p") ;; esac
done
build_prereqs() {
	local p start rc failed=0
	for p in "${order[@]}"; do
		[ -n "${target[$p]:-}" ] || continue
		[ -e "$STATE/done/$p" ] && continue
		echo "== prerequisite $p (make ${target[$p]})"
		start=$(date +%s)
		make --no-print-directory "${target[$p]}"
		rc=$?
		printf '%s\t%s\t%s\n' "$p" $(($(date +%s) - start)) "$rc" >>"$STATE/prereqs.tsv"
		if [ $rc -eq 0 ]; then touch "$STATE/done/$p"; else touch "$STATE/failed/$p"; failed=1; fi
	done
	return $failed
}
setsid nice -n "${CI_PREREQ_NICE:-19}" bash -c "$(declare -f build_prereqs); $(declare -p order target STATE); build_prereqs" \
	>"$STATE/prereqs.log" 2>&1 &
builder=$!
echo "ci: building prerequisites in the background (pid $builder, log $STATE/prereqs.log)"

table() {
	local rc=$1 name secs result waited
	echo
	echo "ci: steps (seconds; a tier's wait for its prerequisites is part of its seconds)"
	printf '  %-24s %7s  %-6s %s\n' step seconds result prerequisites
	while IFS=$'\t' read -r name secs result waited; do
		local pre="" p
		for p in ${needs[$name]:-}; do pre+="${pre:+, }$p (${origin[$p]})"; done
		[ -n "$waited" ] && [ "$waited" != 0 ] && pre+="; waited ${waited}s"
		printf '  %-24s %7s  %-6s %s\n' "$name" "$secs" "$result" "$pre"
	done <"$STATE/steps.tsv"
	echo "ci: prerequisites (built by the background make unless cached; seconds at nice ${CI_PREREQ_NICE:-19})"
	printf '  %-24s %-7s %7s\n' prerequisite origin seconds
	for p in "${prereqs[@]}"; do
		secs=$(awk -F'\t' -v p="$p" '$1==p{s=$2} END{print s}' "$STATE/prereqs.tsv")
		state=${origin[$p]}
		[ -e "$STATE/failed/$p" ] && state=failed
		printf '  %-24s %-7s %7s\n' "$p" "$state" "${secs:--}"
	done
	printf '  %-24s %-7s %7s\n' go-build-cache "$gocache_origin" -
	echo "ci: $( [ "$rc" = 0 ] && echo passed || echo FAILED ) in $(($(date +%s) - T0))s"
}
finish() {
	local rc=$?
	if [ -n "$builder" ] && kill -0 "$builder" 2>/dev/null; then
		kill -TERM -- "-$builder" 2>/dev/null # its session: make and what it runs
	fi
	if [ "$rc" != 0 ] && [ -s "$STATE/prereqs.log" ]; then
		echo "ci: the last lines of the prerequisite builder's log ($STATE/prereqs.log):"
		tail -n 40 "$STATE/prereqs.log" | sed 's/^/  | /'
	fi
	table "$rc"
	exit "$rc"
}
trap finish EXIT

# step NAME COMMAND...: runs one step, records its seconds and result, and
# stops CI at the first failure.
step() {
	local name=$1 start rc
	shift
	echo
	echo "== ci: $name"
	start=$(date +%s)
	"$@"
	rc=$?
	printf '%s\t%s\t%s\t%s\n' "$name" $(($(date +%s) - start)) "$([ $rc = 0 ] && echo ok || echo FAIL)" "${waited:-}" >>"$STATE/steps.tsv"
	[ $rc = 0 ] || exit $rc
}

ready() { # ready TIER: every prerequisite it needs is built (or failed: then the tier shows why)
	local p
	for p in ${needs[$1]}; do
		[ -e "$STATE/done/$p" ] || [ -e "$STATE/failed/$p" ] || return 1
	done
}

go version
step lint make --no-print-directory lint
step tidy-check make --no-print-directory tidy-check
for m in $(make -s --no-print-directory print-modules); do
	step "test $m" make --no-print-directory test MODULES="$m"
done

remaining=("${tiers[@]}")
while [ ${#remaining[@]} -gt 0 ]; do
	pick=""
	for t in "${remaining[@]}"; do
		if ready "$t"; then pick=$t; break; fi
	done
	waited=0
	if [ -z "$pick" ]; then
		pick=${remaining[0]}
		start=$(date +%s)
		echo "== ci: waiting for the prerequisites of $pick (${needs[$pick]})"
		until ready "$pick"; do
			kill -0 "$builder" 2>/dev/null || break
			sleep 2
		done
		waited=$(($(date +%s) - start))
	fi
	step "$pick" make --no-print-directory "$pick"
	waited=""
	next=()
	for t in "${remaining[@]}"; do [ "$t" = "$pick" ] || next+=("$t"); done
	remaining=("${next[@]}")
done
# Every prerequisite is some tier's, so the builder is done by now; its
# status is CI's too.
wait "$builder"
rc=$?
builder=""
[ $rc = 0 ] || { echo "ci: the prerequisite builder failed (exit $rc)" >&2; exit $rc; }
