#!/usr/bin/env bash
# Finds the proxy processes that `make run`'s local-agent left running (they
# outlive the agent on purpose) from its state directory,
# <run-dir>/local-agent/proxies: one <instance>.json per proxy with its pid
# and start time, and PROXYFLEET_INSTANCE=<state file> in the environment of
# every process of the instance.
#
#   scripts/clean.sh check [run-dir]   exit 1, listing them, while any runs
#                                      (or while make run's services run:
#                                      both modes refuse then)
#   scripts/clean.sh stop  [run-dir]   stop them (TERM, then KILL) and
#                                      remove their state
#   scripts/clean.sh services [run-dir]  print "<service> <pid>", one a line,
#                                      for each service of make run still
#                                      running with its state in run-dir
#                                      (scripts/run.sh stops the leftovers of
#                                      a run that crashed with it)
#
# run-dir defaults to $PROXYFLEET_RUN_DIR or .run, as in scripts/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-check}
RUN=${2:-${PROXYFLEET_RUN_DIR:-.run}}
STATE="$RUN/local-agent/proxies"
case "$mode" in
check | stop | services) ;;
*)
	echo "usage: $0 check|stop|services [run-dir]" >&2
	exit 2
	;;
esac

# services_of_run prints "<service> <pid>" for each process started with
# --data-dir <run-dir>/<service>: make run's services, whoever started them.
services_of_run() {
	local run_abs d args i dir parent
	run_abs=$(cd "$RUN" 2>/dev/null && pwd -P) || return 0
	for d in /proc/[0-9]*; do
		mapfile -d '' -t args < <({ cat "$d/cmdline"; } 2>/dev/null) || continue
		for ((i = 0; i < ${#args[@]}; i++)); do
			case "${args[$i]}" in
			--data-dir | -data-dir) dir=${args[$((i + 1))]:-} ;;
			--data-dir=* | -data-dir=*) dir=${args[$i]#*=} ;;
			*) continue ;;
			esac
			case "$dir" in
			/*) ;;
			*) dir="$(readlink "$d/cwd" 2>/dev/null)/$dir" ;;
			esac
			parent=$(cd "$(dirname "$dir")" 2>/dev/null && pwd -P) || continue
			if [ "$parent" = "$run_abs" ]; then echo "$(basename "${args[0]}") ${d#/proc/}"; fi
		done
	done
}

if [ "$mode" = services ]; then
	services_of_run
	exit 0
fi

# The services of make run must be stopped first: their state is what
# clean removes.
mapfile -t services < <(services_of_run)
if [ ${#services[@]} -gt 0 ]; then
	{
		if [ "$mode" = check ]; then what=clean; else what="stop proxies"; fi
		echo "refusing to $what: services of make run still run with their state in $RUN:"
		for s in "${services[@]}"; do echo "  ${s% *} (pid ${s##* })"; done
		echo "Stop make run first (Ctrl-C in its terminal), then try again."
	} >&2
	exit 1
fi

[ -d "$STATE" ] || exit 0

# The agent records absolute paths; match both spellings of the directory.
logical=$(cd "$STATE" && pwd -L)
physical=$(cd "$STATE" && pwd -P)

# proc_field PID N prints field N (1-based, counted after the command name,
# so 1 is the state and 20 the start time) of /proc/PID/stat.
proc_field() {
	local stat
	stat=$( { cat "/proc/$1/stat"; } 2>/dev/null) || return 1
	stat=${stat##*) }
	local -a f
	read -r -a f <<<"$stat"
	echo "${f[$(($2 - 1))]}"
}

# running PID: a live process, not a zombie.
running() {
	local st
	st=$(proc_field "$1" 1) || return 1
	[ "$st" != Z ] && [ "$st" != X ]
}

# json_field FILE KEY prints the first scalar value of KEY in FILE (the
# agent writes its state with encoding/json: one key per line).
json_field() {
	sed -n 's/^ *"'"$2"'": *"\{0,1\}\([^",]*\)"\{0,1\},\{0,1\}$/\1/p' "$1" | head -n 1
}

declare -A pids=() # instance -> live pids of its processes
for d in /proc/[0-9]*; do
	pid=${d#/proc/}
	v=$( { tr '\0' '\n' <"$d/environ"; } 2>/dev/null | grep -m1 '^PROXYFLEET_INSTANCE=' || true)
	[ -n "$v" ] || continue
	path=${v#PROXYFLEET_INSTANCE=}
	case "$path" in
	"$logical"/*.json | "$physical"/*.json) ;;
	*) continue ;;
	esac
	running "$pid" || continue
	name=$(basename "$path" .json)
	pids[$name]+="$pid "
done
for f in "$STATE"/*.json; do
	[ -f "$f" ] || continue
	name=$(basename "$f" .json)
	pid=$(json_field "$f" pid)
	start=$(json_field "$f" startTime)
	# The recorded pid counts only if it is still the process that was
	# started (same start time), never a later one that reused the pid.
	if [ -n "$pid" ] && [ -n "$start" ] && running "$pid" && [ "$(proc_field "$pid" 20)" = "$start" ]; then
		case " ${pids[$name]:-} " in *" $pid "*) ;; *) pids[$name]+="$pid " ;; esac
	fi
done

if [ ${#pids[@]} -eq 0 ]; then
	[ "$mode" = check ] || echo "no proxy process of make run is running (state in $STATE)"
	exit 0
fi

describe() {
	local f="$STATE/$1.json"
	if [ -f "$f" ]; then
		printf '  %s  proxy %s  pool %s  %s:%s  pid %s\n' "$1" "$(json_field "$f" proxyID)" "$(json_field "$f" pool)" \
			"$(json_field "$f" bind)" "$(json_field "$f" port)" "${pids[$1]% }"
	else
		printf '  %s  (no state file)  pid %s\n' "$1" "${pids[$1]% }"
	fi
}

if [ "$mode" = check ]; then
	{
		echo "refusing to clean: ${#pids[@]} proxy instance(s) of make run still run (state in $STATE):"
		for name in $(printf '%s\n' "${!pids[@]}" | sort); do describe "$name"; done
		pools=$(for name in "${!pids[@]}"; do
			if [ -f "$STATE/$name.json" ]; then json_field "$STATE/$name.json" pool; fi
		done | sort -u | tr '\n' ' ')
		cat <<EOT
Removing $RUN now would leave them running with nothing that knows them. Either
  - delete them through proxyfleet: with make run running, for each pool${pools:+ (${pools% })}
      nats req fleet.api.pool.delete '{"name":"<pool>"}'
    and, for the instances of proxies deleted with skipCleanup,
      nats req fleet.api.instance.delete '{"entry":"local","target":"<target>","name":"<instance>"}'
    (the agent's target is the key local.<target> in: nats kv ls fleet-agents)
    then stop make run and run make clean again; or
  - stop them here and now: make clean-proxies, then make clean.
EOT
	} >&2
	exit 1
fi

# stop: TERM every process (and the process group of each session leader),
# wait, then KILL what is left.
signal() {
	local sig=$1 name pid
	for name in "${!pids[@]}"; do
		for pid in ${pids[$name]}; do
			if [ "$(proc_field "$pid" 4 2>/dev/null)" = "$pid" ]; then kill "-$sig" -- "-$pid" 2>/dev/null || true; fi
			kill "-$sig" "$pid" 2>/dev/null || true
		done
	done
}
left() {
	local name pid
	for name in "${!pids[@]}"; do
		for pid in ${pids[$name]}; do
			if running "$pid"; then echo "$pid"; fi
		done
	done
}
wait_gone() {
	for _ in $(seq 1 50); do
		[ -z "$(left)" ] && return 0
		sleep 0.1
	done
	return 1
}
for name in $(printf '%s\n' "${!pids[@]}" | sort); do describe "$name"; done
signal TERM
if ! wait_gone; then
	signal KILL
	if ! wait_gone; then
		echo "processes still run after SIGKILL: $(left | tr '\n' ' ')" >&2
		exit 1
	fi
fi
for name in "${!pids[@]}"; do
	rm -rf "${STATE:?}/$name"
	rm -f "$STATE/$name.json"
done
echo "stopped ${#pids[@]} proxy instance(s) of make run and removed their state"
