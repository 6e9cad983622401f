#!/usr/bin/env bash
# The whole of CI (.ci/run): lint, tidy-check, `make test` module by module
# and every tier of `make test-all`, on a machine whose caches may be empty.
#
# - The cached prerequisites the tiers need (Debian packages, Go modules,
#   kube binaries, images, Jaeger, ...; `make ci-plan` lists them) are
#   built by a second make at the lowest CPU priority from the start, so
#   they use the cycles the tests leave idle instead of running after them.
# - After lint and tidy-check, make test's modules (lane "test") and the
#   tiers (lane "main", and the lanes tier files name with TIER_LANE_<tier>)
#   run side by side, each lane one step at a time; a tier runs as soon as
#   what it needs is built, and one still waiting gives way to the next
#   that is ready. Every cached build holds a lock, so a tier that reaches
#   one still being built waits for it rather than building it again.
# - It ends with a table of every step's seconds and of where each
#   prerequisite came from (the cache, or built by this run), also when a
#   step fails.
#
# Knobs: CI_STATE (a directory for the logs and marks; a new one in /tmp by
# default), CI_PREREQ_NICE (19).
set -uo pipefail
cd "$(dirname "$0")/.."

STATE=${CI_STATE:-$(mktemp -d /tmp/proxyfleet-ci.XXXXXX)}
mkdir -p "$STATE/done" "$STATE/failed"
: >"$STATE/steps.tsv" >"$STATE/prereqs.tsv"
T0=$(date +%s)
builder=""

# cpu_now: the machine's CPU seconds so far, busy and all (every core), and
# the part of busy spent at a raised nice (the builder), from /proc/stat.
cpu_now() {
	awk -v hz="$(getconf CLK_TCK)" '$1 == "cpu" {
		busy = $2 + $3 + $4 + $7 + $8 + $9
		printf "%.0f %.0f %.0f\n", busy / hz, (busy + $5 + $6) / hz, $3 / hz
	}' /proc/stat
}
read -r CPU0_BUSY CPU0_ALL CPU0_NICE < <(cpu_now)

# timed CPUFILE COMMAND...: runs the command and writes the CPU seconds
# (user + system) of the processes it waited for to CPUFILE. Processes
# that others reap (the guests libvirtd starts) are not counted.
timed() {
	local out=$1
	shift
	(
		"$@"
		rc=$?
		times >"$out.times" # in a pipeline it would time a subshell
		awk 'NR == 2 {
			split($0, f, /[ ms]+/)
			printf "%.0f\n", f[1] * 60 + f[2] + f[3] * 60 + f[4]
		}' "$out.times" >"$out"
		exit $rc
	)
}

# The plan: tiers and what each needs, prerequisites and their targets.
plan=$(make -s --no-print-directory ci-plan) || { echo "ci: make ci-plan failed" >&2; exit 1; }
declare -A needs=() lane=() target=() origin=()
tiers=() prereqs=()
while read -r kind name rest; do
	case $kind in
	tier)
		tiers+=("$name")
		lane[$name]=${rest%% *}
		needs[$name]=${rest#"${lane[$name]}"}
		;;
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

# The builder: Debian packages, axe-core, Crawlee and Go modules first (the
# network, while lint and the first tests use the CPU), then the builds in
# the order the tiers want them. Each mark lands in $STATE/done or $STATE/failed.
order=(debian-packages axe crawlee go-modules nats-cli nats-server prev-release guest-image kube-binaries etcd kube-node-images cloud-image otel)
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
# GOGC=400: the compiler spends less of the builds' CPU collecting garbage
# (the builds only; the tests keep the default).
setsid nice -n "${CI_PREREQ_NICE:-19}" env GOGC=400 bash -c "$(declare -f build_prereqs); $(declare -p order target STATE); build_prereqs" \
	>"$STATE/prereqs.log" 2>&1 &
builder=$!
echo "ci: building prerequisites in the background (pid $builder, log $STATE/prereqs.log)"

table() {
	local rc=$1 name secs result waited
	echo
	echo "ci: steps (seconds; a tier's wait for its prerequisites is part of its seconds)"
	echo "(cpu: the CPU seconds of the step's own processes, every core)"
	printf '  %-28s %7s %6s  %-6s %-5s %s\n' step seconds cpu result lane prerequisites
	while IFS=$'\t' read -r name secs result waited ln cpu; do
		local pre="" p
		for p in ${needs[$name]:-}; do pre+="${pre:+, }$p (${origin[$p]})"; done
		[ -n "$waited" ] && [ "$waited" != 0 ] && pre+="; waited ${waited}s"
		printf '  %-28s %7s %6s  %-6s %-5s %s\n' "$name" "$secs" "${cpu:--}" "$result" "$ln" "$pre"
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
	local busy all nice cores
	read -r busy all nice < <(cpu_now)
	cores=$(nproc)
	busy=$((busy - CPU0_BUSY)) all=$((all - CPU0_ALL)) nice=$((nice - CPU0_NICE))
	[ "$all" -gt 0 ] && echo "ci: the machine's $cores cores were busy ${busy} of ${all} CPU seconds ($((100 * busy / all))%; ${nice} s of it at a raised nice: the builder)"
	echo "ci: $( [ "$rc" = 0 ] && echo passed || echo FAILED ) in $(($(date +%s) - T0))s"
}
finish() {
	local rc=$?
	# compile-race, if lint ended the run while it ran beside it.
	[ -n "${cr:-}" ] && kill -0 "$cr" 2>/dev/null && pkill -TERM -P "$cr" 2>/dev/null
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
	timed "$STATE/cpu-$name" "$@"
	rc=$?
	printf '%s\t%s\t%s\t0\t-\t%s\n' "$name" $(($(date +%s) - start)) "$([ $rc = 0 ] && echo ok || echo FAIL)" "$(cat "$STATE/cpu-$name" 2>/dev/null)" >>"$STATE/steps.tsv"
	[ $rc = 0 ] || exit $rc
}

ready() { # ready TIER: every prerequisite it needs is built (or failed: then the tier shows why)
	local p
	for p in ${needs[$1]}; do
		[ -e "$STATE/done/$p" ] || [ -e "$STATE/failed/$p" ] || return 1
	done
}

go version
# Every package's race-instrumented compile, once, beside lint (which
# compiles the other variant): the lanes below start together and would
# each compile the dependencies they share. Each alone keeps about one
# core busy on a cold cache (the chains of the dependency graph); warm,
# each takes seconds.
cr_start=$(date +%s)
timed "$STATE/cpu-compile-race" make --no-print-directory compile-race >"$STATE/step-compile-race.log" 2>&1 &
cr=$!
step lint make --no-print-directory lint
step tidy-check make --no-print-directory tidy-check
wait $cr
rc=$?
echo
echo "== ci: compile-race (beside lint and tidy-check)"
cat "$STATE/step-compile-race.log"
printf '%s\t%s\t%s\t0\t-\t%s\n' compile-race $(($(date +%s) - cr_start)) "$([ $rc = 0 ] && echo ok || echo FAIL)" "$(cat "$STATE/cpu-compile-race" 2>/dev/null)" >>"$STATE/steps.tsv"
cr=""
[ $rc = 0 ] || exit $rc

# lane_ended LANE...: whether any of the lanes has ended.
lane_ended() {
	local l
	for l in "$@"; do [ -e "$STATE/lane-$l.done" ] && return 0; done
	return 1
}

# run_lane LANE STEP...: runs the lane's steps (tiers, or test:<module> for
# one module of make test) one after another, each as soon as what it
# needs is built (a tier still waiting gives way to the next one that is
# ready). Lanes run side by side, so a step's output is printed whole when
# it ends; the first failure stops every lane at its next step.
run_lane() {
	local lane=$1 pick t start waited rc secs next log cpu
	shift
	local remaining=("$@")
	if [ -n "${lane_after[$lane]:-}" ]; then
		until lane_ended ${lane_after[$lane]} || [ -e "$STATE/stop" ]; do sleep 2; done
	fi
	while [ ${#remaining[@]} -gt 0 ]; do
		[ -e "$STATE/stop" ] && return 1
		pick=""
		for t in "${remaining[@]}"; do
			if ready "$t"; then pick=$t; break; fi
		done
		waited=0
		if [ -z "$pick" ]; then
			pick=${remaining[0]}
			start=$(date +%s)
			until ready "$pick"; do
				kill -0 "$builder" 2>/dev/null || break
				sleep 2
			done
			waited=$(($(date +%s) - start))
		fi
		start=$(date +%s)
		log=$STATE/step-${pick//\//_}.log
		cpu=$STATE/cpu-${pick//\//_}
		case $pick in
		test:e2e) GOTEST_SELECT=-skip GOTEST_PATTERN="$E2E_AFTER" timed "$cpu" make --no-print-directory test MODULES=e2e >"$log" 2>&1 ;;
		test:e2e-after) GOTEST_SELECT=-run GOTEST_PATTERN="$E2E_AFTER" timed "$cpu" make --no-print-directory test MODULES=e2e >"$log" 2>&1 ;;
		test:*) timed "$cpu" make --no-print-directory test MODULES="${pick#test:}" >"$log" 2>&1 ;;
		*) timed "$cpu" make --no-print-directory "$pick" >"$log" 2>&1 ;;
		esac
		rc=$?
		secs=$(($(date +%s) - start + waited))
		printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$pick" "$secs" "$([ $rc = 0 ] && echo ok || echo FAIL)" "$waited" "$lane" "$(cat "$cpu" 2>/dev/null)" >>"$STATE/steps.tsv"
		{
			flock 7
			echo
			echo "== ci: $pick (lane $lane; ${secs}s, of which ${waited}s waiting for prerequisites; $([ $rc = 0 ] && echo ok || echo FAILED))"
			cat "$log"
		} 7>"$STATE/out.lock"
		if [ $rc != 0 ]; then
			touch "$STATE/stop"
			return $rc
		fi
		next=()
		for t in "${remaining[@]}"; do [ "$t" = "$pick" ] || next+=("$t"); done
		remaining=("${next[@]}")
	done
	touch "$STATE/lane-$lane.done"
}

# make test's modules in a lane of their own, then the tiers by lane, in
# plan order; every lane at once. Most tiers spend their time waiting on
# processes, VMs and timers: run one after another they leave the CPU
# idle more than half the time.
# A lane may wait for one of others to end first: the kvm tiers boot VMs
# under TCG, whose boot deadlines (12 minutes) are not meant to share the
# CPU with make test's compiles and the other tiers all at once, so they
# start when the first of the other lanes is done (the upgrade lane, in
# warm runs; measured: three cloud boots beside the e2e module, 312-356 s
# each, within their deadlines).
declare -A lane_tiers=() lane_after=([kvm]="test main upgrade")
lanes=(test)
for m in $(make -s --no-print-directory print-modules); do
	lane_tiers[test]+=" test:$m"
	needs[test:$m]=""
done
for t in "${tiers[@]}"; do
	l=${lane[$t]}
	[ -n "${lane_tiers[$l]:-}" ] || lanes+=("$l")
	lane_tiers[$l]+=" $t"
done
# The e2e module is the test lane's longest step. Its acceptance tests of
# placement, tiers and external pools (E2E_AFTER: about 200 s, mostly
# waiting on timers and processes) run as a step of their own
# (test:e2e-after) in the upgrade lane, whose tiers also mostly wait;
# test:e2e skips them, so every test of the module runs exactly once.
E2E_AFTER='^(TestSpreadOverLabelledTargets|TestRegionSelectionThroughTheGateway|TestFallbackTierThroughTheGateway|TestPlacementBadInput|TestExternalPool|TestGatewayUnderMakeRun)$'
if [ -n "${lane_tiers[upgrade]:-}" ]; then
	lane_tiers[upgrade]+=" test:e2e-after"
else
	lane_tiers[test]+=" test:e2e-after"
fi
needs[test:e2e-after]=""
echo
echo "== ci: make test and the tiers in ${#lanes[@]} lanes: $(for l in "${lanes[@]}"; do printf '%s:%s; ' "$l" "${lane_tiers[$l]}"; done)"
lane_pids=()
for l in "${lanes[@]}"; do
	# shellcheck disable=SC2086 # the list is words
	run_lane "$l" ${lane_tiers[$l]} &
	lane_pids+=($!)
done
failed=0
for pid in "${lane_pids[@]}"; do
	wait "$pid" || failed=1
done
[ $failed = 0 ] || exit 1

# Every prerequisite is some tier's, so the builder is done by now; its
# status is CI's too.
wait "$builder"
rc=$?
builder=""
[ $rc = 0 ] || { echo "ci: the prerequisite builder failed (exit $rc)" >&2; exit $rc; }
