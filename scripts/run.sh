#!/usr/bin/env bash
# Starts the whole system on one machine: the planner (hosting the embedded
# NATS server), the health service, a local-agent, the crawler gateway and
# the console, each as its own process, with state under ./.run. Ctrl-C,
# SIGTERM and SIGHUP stop them in order (console, gateway, agent, health,
# planner); they stop by
# themselves if the script dies; a run finds the services an earlier one
# left and stops them. Proxy processes keep running and are found again by
# the next `make run` (see docs/local.md).
#
#   scripts/run.sh                  run until Ctrl-C, SIGINT, SIGTERM or SIGHUP (make run)
#   scripts/run.sh rebuild-views    have the running make run rebuild health's
#                                   views: stop health, run health
#                                   --rebuild-views, start health again
#                                   (make rebuild-views)
#
# Knobs (environment):
#   PROXYFLEET_RUN_DIR    state and logs (.run)
#   PROXYFLEET_NATS_ADDR  the embedded NATS server's client address
#                         (127.0.0.1:4222; port 0: a free port)
#   PROXYFLEET_ECHO_ADDR  health's echo endpoint (127.0.0.1:8480; port 0: a
#                         free port)
#   PROXYFLEET_GATEWAY_ADDR  the gateway's client address (127.0.0.1:8888;
#                         port 0: a free port); it accepts any password there
#   PROXYFLEET_CONSOLE_ADDR  the console's address (127.0.0.1:8090; port 0: a
#                         free port); open without sign-in, so loopback only
#   PROXYFLEET_PORTS      the local-agent's proxy port range (20000-20999)
#                         (0: ports from the kernel; give the agent --capacity)
#   PROXYFLEET_BIN        where planner, health, local-agent, gateway, console and nats
#                         are (./bin)
#   PROXYFLEET_LOG_LEVEL  every service's log level (info)
#   PROXYFLEET_LABELS     the local-agent's target labels, key=value[,...]
#                         (region=local; empty: none); the banner's labelled
#                         example uses the first
#   PLANNER_FLAGS, HEALTH_FLAGS, AGENT_FLAGS, GATEWAY_FLAGS, CONSOLE_FLAGS
#                         extra flags for each service, split at spaces
#                         (AGENT_FLAGS="--source-addrs 203.0.113.10 --log-level debug")
#   OTEL_EXPORTER_OTLP_ENDPOINT and the other OTEL_* variables reach the
#                         services unchanged (make observe's Jaeger:
#                         http://127.0.0.1:4318)
#
# Each service serves Prometheus metrics on a port from the kernel
# (--metrics-addr 127.0.0.1:0 unless its *_FLAGS name one); the banner
# prints the URLs and <run-dir>/metrics-targets.json lists them for
# Prometheus's file_sd (make observe).
#
# make run owns its NATS server: the services ignore the shell's NATS_URL,
# NATS_CONTEXT and NATS_CREDS. The server requires credentials: make run
# writes a user and password per service and one for the nats CLI into
# <run-dir>/nats (mode 0700). <run-dir>/nats.env points the nats CLI of
# another shell at the server with them (`. .run/nats.env`).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-serve}
BIN=${PROXYFLEET_BIN:-./bin}
RUN=${PROXYFLEET_RUN_DIR:-.run}
PIDFILE=$RUN/run.pid
REBUILD_RESULT=$RUN/rebuild-views.result

# running_script prints the pid of the make run using $RUN, if one runs.
running_script() {
	local pid
	pid=$(cat "$PIDFILE" 2>/dev/null) || return 1
	[ -n "$pid" ] && [ "$pid" != $$ ] || return 1
	tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q 'scripts/run\.sh' || return 1
	echo "$pid"
}

case "$mode" in
serve) ;;
rebuild-views)
	if ! pid=$(running_script); then
		echo "make run is not running with its state in $RUN: start it first, or run health --rebuild-views against your own server (docs/operator-guide.md)" >&2
		exit 1
	fi
	rm -f "$REBUILD_RESULT"
	kill -USR1 "$pid"
	echo "asked make run (pid $pid) to rebuild the views; waiting..."
	for _ in $(seq 1 3000); do
		if [ -s "$REBUILD_RESULT" ]; then
			result=$(cat "$REBUILD_RESULT")
			echo "$result"
			case "$result" in ok:*) exit 0 ;; *) exit 1 ;; esac
		fi
		if ! kill -0 "$pid" 2>/dev/null; then
			echo "make run stopped before the views were rebuilt; see $RUN/logs/health.log" >&2
			exit 1
		fi
		sleep 0.1
	done
	echo "no answer from make run after 5 minutes; see $RUN/logs/health.log" >&2
	exit 1
	;;
*)
	echo "usage: $0 [rebuild-views]" >&2
	exit 2
	;;
esac

# Every process this script starts gets SIGTERM from the kernel when the
# script dies, however it dies (kill -9 included): setpriv --pdeathsig sets
# the parent-death signal (prctl PR_SET_PDEATHSIG), which exec keeps. A
# watchdog process could itself be killed or stopped; the kernel's signal
# cannot be missed.
if ! command -v setpriv >/dev/null; then
	echo "setpriv is missing (Debian package util-linux): make run needs it so its services stop with it" >&2
	exit 1
fi

# On a terminal, Ctrl-C sends SIGINT to the whole foreground process group:
# to make as well as to this script, and make then dies of it (exit 130)
# whatever the script does. With job control on, bash runs the rest of the
# script as a job in a process group of its own that it gives the terminal
# to, so Ctrl-C reaches that job alone and make gets its exit status. Bash
# gives the terminal through its standard error: when that is a file or a
# pipe, the job would stay in the background, deaf to Ctrl-C, while make
# and this script die of it; the script then runs as it is, in make's
# process group, and stops everything on the SIGINT it shares with make.
# The job dies with this script (the parent-death signal), so closing the
# terminal, which kills this script and make, stops it too.
if [ -t 0 ] && [ -t 2 ] && [ -z "${PROXYFLEET_RUN_JOB:-}" ]; then
	set -m
	PROXYFLEET_RUN_JOB=1 setpriv --pdeathsig TERM "$0" "$@" && exit 0 || exit $?
fi

NATS_ADDR=${PROXYFLEET_NATS_ADDR:-127.0.0.1:4222}
ECHO_ADDR=${PROXYFLEET_ECHO_ADDR:-127.0.0.1:8480}
GATEWAY_ADDR=${PROXYFLEET_GATEWAY_ADDR:-127.0.0.1:8888}
CONSOLE_ADDR=${PROXYFLEET_CONSOLE_ADDR:-127.0.0.1:8090}
PORTS=${PROXYFLEET_PORTS:-20000-20999}
LABELS=${PROXYFLEET_LABELS-region=local}
read -r -a planner_flags <<<"${PLANNER_FLAGS:-}"
read -r -a health_flags <<<"${HEALTH_FLAGS:-}"
read -r -a agent_flags <<<"${AGENT_FLAGS:-}"
read -r -a gateway_flags <<<"${GATEWAY_FLAGS:-}"
read -r -a console_flags <<<"${CONSOLE_FLAGS:-}"
# The shell's NATS settings are for the operator's own servers, not for the
# one make run embeds (the services read the first three, the nats CLI all).
NATS_VARS="NATS_URL NATS_CONTEXT NATS_CREDS NATS_USER NATS_PASSWORD NATS_TOKEN NATS_NKEY NATS_JWT NATS_SEED NATS_CERT NATS_KEY NATS_CA NATS_SOCKS_PROXY"
# shellcheck disable=SC2086
unset $NATS_VARS PROXYFLEET_DATA_DIR

for b in planner health local-agent gateway console nats; do
	if [ ! -x "$BIN/$b" ]; then
		echo "$BIN/$b is missing: start make run, which builds what it runs" >&2
		exit 1
	fi
done
mkdir -p "$RUN/logs"
abs_run=$(cd "$RUN" && pwd)
abs_bin=$(cd "$BIN" && pwd)
if pid=$(running_script); then
	echo "make run already runs with its state in $RUN (pid $pid); stop it first or set PROXYFLEET_RUN_DIR" >&2
	exit 1
fi
# The script of a run that crashed (stop_leftovers names it).
previous_script=$(cat "$PIDFILE" 2>/dev/null || true)
echo $$ >"$PIDFILE"
rm -f "$REBUILD_RESULT"

declare -A pid=() # service -> pid; every service runs in a session of its own
declare -A log_from=() # service -> size of its log before this start
declare -A metrics=()  # service -> the address its /metrics is served on
order=(planner health local-agent gateway console)
url=""

# exited PID: the process has exited (a zombie until reaped) or is gone.
exited() {
	local stat
	stat=$( { cat "/proc/$1/stat"; } 2>/dev/null) || return 0
	stat=${stat##*) }
	case "${stat%% *}" in Z | X) return 0 ;; esac
	return 1
}

# A run whose script is gone may have left services behind: ones started
# before the parent-death signal, or ones that could not act on it (stopped,
# hung). They hold the NATS port and the state directory, so they are
# stopped (SIGTERM and SIGCONT, SIGKILL after 30 s) rather than adopted: a
# process that is not this script's child cannot be waited for, and its
# logs and ports would not be this run's. Proxies are not services: the new
# agent finds them in its state directory and manages them again.
stop_leftovers() {
	local name p said="" list=()
	declare -A found=() # service -> its pids
	while read -r name p; do
		found[$name]+="$p "
	done < <(./scripts/clean.sh services "$RUN")
	[ ${#found[@]} -gt 0 ] || return 0
	# In the order of a clean stop, then anything else started there.
	for name in console gateway local-agent health planner; do
		[ -z "${found[$name]:-}" ] || list+=("$name")
	done
	for name in "${!found[@]}"; do
		case " ${list[*]} " in *" $name "*) ;; *) list+=("$name") ;; esac
	done
	for name in "${list[@]}"; do
		for p in ${found[$name]}; do said+="${said:+, }$name (pid $p)"; done
	done
	echo "found leftovers of an earlier make run with its state in $RUN${previous_script:+ (its script, pid $previous_script, is gone)}: stopping $said"
	for name in "${list[@]}"; do
		for p in ${found[$name]}; do
			kill -TERM "$p" 2>/dev/null || true
			# A stopped process keeps SIGTERM pending until it continues.
			kill -CONT "$p" 2>/dev/null || true
			for _ in $(seq 1 300); do
				exited "$p" && break
				sleep 0.1
			done
			if ! exited "$p"; then
				echo "$name (pid $p) did not stop within 30s of SIGTERM; killing it" >&2
				kill -KILL "$p" 2>/dev/null || true
				while ! exited "$p"; do sleep 0.1; done
			fi
		done
	done
	echo "stopped them; starting afresh (their proxies keep running for the new local-agent)"
}
stop_leftovers

# reap PID waits for the child PID and sets status to its exit status. A
# trapped signal interrupts wait; the wait goes on while PID exists.
status=0
reap() {
	status=0
	wait "$1" 2>/dev/null || status=$?
	while [ -e "/proc/$1" ]; do
		status=0
		wait "$1" 2>/dev/null || status=$?
	done
}

# stop_service NAME: SIGTERM, wait up to 30 s, then SIGKILL. What did not
# go cleanly is added to $problems.
problems=""
stop_service() {
	local name=$1 p=${pid[$1]:-}
	[ -n "$p" ] || return 0
	kill -TERM "$p" 2>/dev/null || true
	for _ in $(seq 1 300); do
		exited "$p" && break
		sleep 0.1
	done
	if ! exited "$p"; then
		problems+="$name (pid $p) did not stop within 30s of SIGTERM and was killed; see $RUN/logs/$name.log"$'\n'
		kill -KILL "$p" 2>/dev/null || true
	fi
	reap "$p"
	unset "pid[$name]"
	if [ "$status" -ne 0 ] && [ "$status" -ne 143 ]; then
		problems+="$name exited with status $status while stopping; see $RUN/logs/$name.log"$'\n'
	fi
}

# stop_all stops the services in the reverse order of their start and says
# so in one line, or names what did not stop cleanly and fails.
stopped=""
stop_all() {
	local i
	[ -z "$stopped" ] || return 0
	stopped=1
	trap '' INT TERM HUP USR1
	for ((i = ${#order[@]} - 1; i >= 0; i--)); do
		stop_service "${order[$i]}"
	done
	rm -f "$PIDFILE"
	if [ -n "$problems" ]; then
		printf '%s' "$problems" >&2
		return 1
	fi
	echo "stopped console, gateway, local-agent, health and planner; proxies keep running (the next make run manages them, make clean-proxies stops them)"
}

# on_signal stops everything, whatever became of the output: Ctrl-C kills
# a tee reading it, and closing the terminal makes writes to it fail. A
# failed write must not end the script (set -e) or kill it (SIGPIPE)
# before the services are stopped.
on_signal() {
	set +e
	trap '' PIPE
	if [ -t 1 ]; then echo; fi # end the line of the terminal's ^C
	trap - EXIT
	if stop_all; then exit 0; fi
	exit 1
}
trap on_signal INT TERM HUP
trap 'stop_all >/dev/null || true' EXIT
rebuild_requested=""
trap 'rebuild_requested=1' USR1

# crashed NAME: a service exited on its own; stop the others and fail.
crashed() {
	local name=$1
	reap "${pid[$name]}"
	unset "pid[$name]"
	{
		echo "$name exited unexpectedly (status $status); last lines of $RUN/logs/$name.log:"
		tail -n 20 "$RUN/logs/$name.log" | sed 's/^/  /'
	} >&2
	trap - EXIT
	stop_all >/dev/null || true
	exit 1
}

# check_running NAME...: fail as crashed when one of them exited.
check_running() {
	local name
	for name in "$@"; do
		if [ -n "${pid[$name]:-}" ] && exited "${pid[$name]}"; then crashed "$name"; fi
	done
}

start() {
	local name=$1
	shift
	log_from[$name]=$(stat -c %s "$RUN/logs/$name.log" 2>/dev/null || echo 0)
	# The log exists before the service starts: the background job opens
	# it only once forked, and the callers read it at once (under set -e
	# and pipefail, a tail of a missing file would end the script).
	: >>"$RUN/logs/$name.log"
	setpriv --pdeathsig TERM setsid "$BIN/$name" "$@" </dev/null >>"$RUN/logs/$name.log" 2>&1 &
	pid[$name]=$!
}

# metrics_args FLAG...: --metrics-addr 127.0.0.1:0 unless the service's
# own flags set the address (an empty one turns its metrics off).
metrics_args() {
	local f
	for f in "$@"; do
		case "$f" in --metrics-addr | --metrics-addr=* | -metrics-addr | -metrics-addr=*) return 0 ;; esac
	done
	echo "--metrics-addr 127.0.0.1:0"
}

# metrics_addr NAME: the address the service logged its metrics endpoint
# on since its last start (it logs it before connecting to NATS).
metrics_addr() {
	tail -c +$((${log_from[$1]:-0} + 1)) "$RUN/logs/$1.log" 2>/dev/null |
		sed -n 's/.*"msg":"metrics endpoint serving".*"addr":"\([^"]*\)".*/\1/p' | tail -n 1
}

# write_metrics_targets writes <run-dir>/metrics-targets.json, the
# services' metrics endpoints in Prometheus's file_sd format.
write_metrics_targets() {
	local name sep="" out="["
	for name in "${order[@]}"; do
		[ -n "${metrics[$name]:-}" ] || continue
		out+="$sep"$'\n'"  {\"targets\":[\"${metrics[$name]}\"],\"labels\":{\"service\":\"$name\"}}"
		sep=","
	done
	printf '%s\n]\n' "$out" >"$RUN/metrics-targets.json.tmp"
	mv -f "$RUN/metrics-targets.json.tmp" "$RUN/metrics-targets.json"
}

# The embedded NATS server lets in only the users make run made: one per
# service it starts and "operator" for the nats CLI, each with a random
# password kept in $RUN/nats (a directory only its owner may enter, files
# mode 0600) across runs, so another local user or process gets nothing
# from the port. The planner embeds the server and needs no password.
NATS_DIR=$RUN/nats
nats_users=(health local-agent gateway console operator)
(
	umask 077
	mkdir -p "$NATS_DIR"
	chmod 700 "$NATS_DIR"
	for u in "${nats_users[@]}"; do
		if [ ! -s "$NATS_DIR/$u.password" ]; then
			od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$NATS_DIR/$u.password.tmp"
			mv -f "$NATS_DIR/$u.password.tmp" "$NATS_DIR/$u.password"
		fi
	done
	{
		echo "# make run's NATS users (scripts/run.sh), one per service and operator for the nats CLI"
		echo "authorization {"
		echo "  users: ["
		for u in "${nats_users[@]}"; do
			printf '    { user: "%s", password: "%s" }\n' "$u" "$(cat "$NATS_DIR/$u.password")"
		done
		echo "  ]"
		echo "}"
	} >"$NATS_DIR/server.conf.tmp"
	mv -f "$NATS_DIR/server.conf.tmp" "$NATS_DIR/server.conf"
)
rm -f "$RUN/nats-context.json" # a context without credentials, of earlier runs

# nats_context USER writes the nats context (URL and credentials) USER
# connects with, $RUN/nats/USER.json, once the server's URL is known.
nats_context() {
	(
		umask 077
		printf '{"description":"make run, as %s","url":"%s","user":"%s","password":"%s"}\n' \
			"$1" "$url" "$1" "$(cat "$NATS_DIR/$1.password")" >"$NATS_DIR/$1.json.tmp"
		mv -f "$NATS_DIR/$1.json.tmp" "$NATS_DIR/$1.json"
	)
}

# natsq runs the pinned nats CLI against make run's server only.
natsq() {
	NATS_CONTEXT="$abs_run/nats/operator.json" "$BIN/nats" "$@"
}

if [ "${NATS_ADDR##*:}" != 0 ] && (exec 3<>"/dev/tcp/${NATS_ADDR%:*}/${NATS_ADDR##*:}") 2>/dev/null; then
	echo "something already listens on $NATS_ADDR; stop it, or set PROXYFLEET_NATS_ADDR (port 0 picks a free one)" >&2
	exit 1
fi
if [ "${GATEWAY_ADDR##*:}" != 0 ] && (exec 3<>"/dev/tcp/${GATEWAY_ADDR%:*}/${GATEWAY_ADDR##*:}") 2>/dev/null; then
	echo "something already listens on $GATEWAY_ADDR; stop it, or set PROXYFLEET_GATEWAY_ADDR (port 0 picks a free one)" >&2
	exit 1
fi
if [ "${CONSOLE_ADDR##*:}" != 0 ] && (exec 3<>"/dev/tcp/${CONSOLE_ADDR%:*}/${CONSOLE_ADDR##*:}") 2>/dev/null; then
	echo "something already listens on $CONSOLE_ADDR; stop it, or set PROXYFLEET_CONSOLE_ADDR (port 0 picks a free one)" >&2
	exit 1
fi

rm -f "$RUN"/planner/planner_*.ports "$RUN/metrics-targets.json"
read -r -a planner_metrics <<<"$(metrics_args "${planner_flags[@]}")"
read -r -a health_metrics <<<"$(metrics_args "${health_flags[@]}")"
read -r -a agent_metrics <<<"$(metrics_args "${agent_flags[@]}")"
read -r -a gateway_metrics <<<"$(metrics_args "${gateway_flags[@]}")"
read -r -a console_metrics <<<"$(metrics_args "${console_flags[@]}")"
start planner --data-dir "$RUN/planner" --nats-listen "$NATS_ADDR" --nats-server-config "$NATS_DIR/server.conf" "${planner_metrics[@]}" "${planner_flags[@]}"
# The embedded server writes its client URL (with the port the kernel
# chose for port 0) to <data-dir>/<program>_<pid>.ports once it listens.
ports_file="$RUN/planner/planner_${pid[planner]}.ports"
for _ in $(seq 1 600); do
	url=$(sed -n 's/.*"nats":\["\([^"]*\)".*/\1/p' "$ports_file" 2>/dev/null || true)
	[ -z "$url" ] || break
	check_running planner
	sleep 0.1
done
if [ -z "$url" ]; then
	echo "the planner's NATS server did not start listening within 60s; see $RUN/logs/planner.log" >&2
	exit 1
fi
for u in "${nats_users[@]}"; do nats_context "$u"; done
# Started with a context (its URL), health never embeds a server.
health_args=(--nats-context "$NATS_DIR/health.json" --data-dir "$RUN/health" "${health_flags[@]}")

echo_log_from=$(stat -c %s "$RUN/logs/health.log" 2>/dev/null || echo 0)
start health "${health_args[@]}" "${health_metrics[@]}" --echo-addr "$ECHO_ADDR"
# The proxies refuse loopback and this host's addresses (docs/egress.md):
# the agent allows exactly the echo endpoint the probes fetch, so health
# must say where it listens first. An empty PROXYFLEET_ECHO_ADDR has health
# probe the --echo-url of HEALTH_FLAGS, which the policy must allow itself.
echo_addr=""
echo_listen=""
egress_args=()
for _ in $(seq 1 300); do
	[ -n "$ECHO_ADDR" ] || break
	echo_addr=$(tail -c +$((echo_log_from + 1)) "$RUN/logs/health.log" |
		sed -n 's/.*"msg":"echo endpoint serving".*"addr":"\([^"]*\)".*/\1/p' | tail -n 1)
	[ -z "$echo_addr" ] || break
	check_running health
	sleep 0.1
done
echo_url="(health's --echo-url)"
if [ -n "$ECHO_ADDR" ]; then
	if [ -z "$echo_addr" ]; then
		echo "health's echo endpoint did not start within 30s; see $RUN/logs/health.log" >&2
		exit 1
	fi
	# A restarted health (make rebuild-views) listens on the same address.
	echo_listen=$echo_addr
	# A wildcard listener is probed on loopback (health's default echo URL).
	case "${echo_addr%:*}" in "" | 0.0.0.0 | "[::]") echo_addr="127.0.0.1:${echo_addr##*:}" ;; esac
	echo_url="http://$echo_addr/"
	egress_args=(--egress-allow "$echo_addr")
fi
# The target's labels, which every proxy placed on it carries: the
# banner's labelled example places and selects by the first.
label_args=()
label_key="" label_value=""
if [ -n "$LABELS" ]; then
	label_args=(--labels "$LABELS")
	label_key=${LABELS%%,*}
	label_value=${label_key#*=}
	label_key=${label_key%%=*}
fi
start local-agent --nats-context "$NATS_DIR/local-agent.json" --data-dir "$RUN/local-agent" --ports "$PORTS" "${egress_args[@]}" "${label_args[@]}" "${agent_metrics[@]}" "${agent_flags[@]}"

# The banner's commands need an agent: the planner refuses a pool whose
# provider no agent has announced.
for _ in $(seq 1 300); do
	# Keys are <entry>.<target>; an empty bucket prints a sentence.
	if natsq kv ls fleet-agents 2>/dev/null | grep -q '^[a-z0-9-]*\.[a-z0-9-]*$'; then break; fi
	check_running health local-agent
	sleep 0.1
done

# The gateway, started last: it routes to the proxies health finds ready.
gateway_log_from=$(stat -c %s "$RUN/logs/gateway.log" 2>/dev/null || echo 0)
# --ca-out: the gateway CA's certificate, which clients of pools with
# gateway.intercept trust (docs/gateway.md#interception-https).
start gateway --nats-context "$NATS_DIR/gateway.json" --data-dir "$RUN/gateway" --listen "$GATEWAY_ADDR" --ca-out "$RUN/gateway-ca.pem" "${gateway_metrics[@]}" "${gateway_flags[@]}"
gateway_addr=""
for _ in $(seq 1 600); do
	gateway_addr=$(tail -c +$((gateway_log_from + 1)) "$RUN/logs/gateway.log" |
		sed -n 's/.*"msg":"gateway serving".*"listen":"\([^"]*\)".*/\1/p' | tail -n 1)
	[ -z "$gateway_addr" ] || break
	check_running gateway
	sleep 0.1
done
if [ -z "$gateway_addr" ]; then
	echo "the gateway did not start serving within 60s; see $RUN/logs/gateway.log" >&2
	exit 1
fi
gateway_name=$(tail -c +$((gateway_log_from + 1)) "$RUN/logs/gateway.log" |
	sed -n 's/.*"msg":"gateway serving".*"name":"\([^"]*\)".*/\1/p' | tail -n 1)

# The console: without --users it lets every visitor act, so it listens on
# loopback only (it refuses anything else without a users file).
console_log_from=$(stat -c %s "$RUN/logs/console.log" 2>/dev/null || echo 0)
start console --nats-context "$NATS_DIR/console.json" --data-dir "$RUN/console" --listen "$CONSOLE_ADDR" "${console_metrics[@]}" "${console_flags[@]}"
console_addr=""
for _ in $(seq 1 600); do
	console_addr=$(tail -c +$((console_log_from + 1)) "$RUN/logs/console.log" |
		sed -n 's/.*"msg":"console serving".*"listen":"\([^"]*\)".*/\1/p' | tail -n 1)
	[ -z "$console_addr" ] || break
	check_running console
	sleep 0.1
done
if [ -z "$console_addr" ]; then
	echo "the console did not start serving within 60s; see $RUN/logs/console.log" >&2
	exit 1
fi

# Every service logs its metrics endpoint before it connects to NATS, so
# by now the lines are there; a service whose flags turned metrics off
# has none.
metrics_urls=""
for name in "${order[@]}"; do
	metrics[$name]=$(metrics_addr "$name")
	if [ -n "${metrics[$name]}" ]; then
		metrics_urls+="${metrics_urls:+, }$name http://${metrics[$name]}/metrics"
	fi
done
write_metrics_targets

cat >"$RUN/nats.env" <<EOT
# Points the pinned nats CLI at make run's NATS server: . $RUN/nats.env
export PATH="$abs_bin:\$PATH"
export NATS_URL=$url
export NATS_CONTEXT=$abs_run/nats/operator.json
unset ${NATS_VARS#NATS_URL NATS_CONTEXT }
EOT

# cmd COMMAND [COMMENT] prints one line of the banner's commands.
cmd() {
	if [ -n "${2:-}" ]; then printf '  %-48s # %s\n' "$1" "$2"; else printf '  %s\n' "$1"; fi
}
echo
echo "proxyfleet is running: embedded NATS at $url (credentials in $RUN/nats), echo endpoint at $echo_url,"
echo "crawler gateway at http://$gateway_addr (it accepts any password on loopback; docs/gateway.md)"
echo "console at http://$console_addr/ (open without login on loopback: every visitor is an operator; docs/console.md)"
if [ -n "$metrics_urls" ]; then
	echo "metrics: $metrics_urls"
fi
if [ -n "${OTEL_EXPORTER_OTLP_ENDPOINT:-}${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-}" ]; then
	echo "traces: OTLP to ${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-$OTEL_EXPORTER_OTLP_ENDPOINT}"
fi
echo "In another terminal, in this directory, point the pinned nats CLI at it:"
echo
cmd ". $RUN/nats.env" "PATH with ./bin; this server's URL and credentials"
echo
cmd "nats micro ls" "planner, health's agents: the fleet's services"
cmd "nats req fleet.api.pool.apply '{\"name\":\"demo\",\"provider\":\"local\",\"size\":3}'"
cmd "nats kv watch fleet-proxies" "watch proxies go requested -> running -> ready"
cmd "nats req fleet.api.proxy.list '{\"pool\":\"demo\",\"limit\":100}'" "ids and addresses, a page of 100"
cmd "nats req fleet.api.proxy.list '{\"pool\":\"demo\",\"limit\":100,\"after\":\"<next>\"}'" "the following page: <next> is the reply's \"next\", \"\" when done"
cmd "curl -x http://<address> $echo_url" "a request through one proxy (address from the list)"
cmd "curl -x http://demo:x@$gateway_addr -i $echo_url" "through the gateway: X-Proxyfleet-Proxy names the proxy"
cmd "curl -x http://demo.session-abc:x@$gateway_addr -i $echo_url" "a sticky session: one proxy for session abc"
if [ -n "$label_key" ]; then
	cmd "nats req fleet.api.pool.apply '{\"name\":\"demo\",\"provider\":\"local\",\"size\":3,\"placement\":{\"require\":{\"$label_key\":[\"$label_value\"]}}}'" "placed by label: on targets with $label_key=$label_value"
	cmd "curl -x http://demo.$label_key-$label_value:x@$gateway_addr -i $echo_url" "only proxies labelled $label_key=$label_value (docs/gateway.md)"
fi
cmd "nats req fleet.gateway.$gateway_name.stats ''" "the gateway's counters per pool and proxy"
cmd "nats req fleet.api.pool.apply '{\"name\":\"demo\",\"provider\":\"local\",\"size\":3,\"gateway\":{\"intercept\":true}}'" "HTTPS interception for demo"
cmd "curl --cacert $RUN/gateway-ca.pem -x http://demo:x@$gateway_addr -i https://example.com/" "HTTPS seen by the gateway: X-Proxyfleet-Proxy per request (CA: $RUN/gateway-ca.pem)"
cmd "nats req fleet.api.pool.apply '{\"name\":\"demo\",\"provider\":\"local\",\"size\":1}'" "scale down"
cmd "nats req fleet.api.pool.delete '{\"name\":\"demo\"}'"
cmd "nats sub --stream FLEET_EVENTS --all -T --raw" "the event log, the source of truth (JSON lines)"
cat <<EOT

Logs: $RUN/logs/<service>.log; each proxy's own log: $RUN/local-agent/proxies/px-…/proxy.log
(make logs shows the last warnings and errors of every service and proxy).
make observe in another terminal runs Prometheus and Jaeger on these services (docs/observability.md).
Press Ctrl-C to stop.
EOT

# rebuild_views serves make rebuild-views: health stops, replays the event
# log into its views, and starts again; the answer goes to $REBUILD_RESULT.
rebuild_views() {
	local result
	rebuild_requested=""
	echo "make rebuild-views: stopping health to rebuild its views"
	stop_service health
	if [ -n "$problems" ]; then
		printf '%s' "$problems" >&2
		problems=""
	fi
	start health "${health_args[@]}" --rebuild-views
	reap "${pid[health]}"
	unset "pid[health]"
	# The same metrics address as before, so make observe's targets hold.
	start health "${health_args[@]}" ${metrics[health]:+--metrics-addr "${metrics[health]}"} --echo-addr "${echo_listen:-$ECHO_ADDR}"
	if [ "$status" -eq 0 ]; then
		result="ok: views rebuilt from FLEET_EVENTS; health runs again (pid ${pid[health]})"
	else
		result="failed: health --rebuild-views exited with status $status; see $RUN/logs/health.log; health runs again"
	fi
	echo "make rebuild-views: ${result}"
	echo "$result" >"$REBUILD_RESULT.tmp"
	mv -f "$REBUILD_RESULT.tmp" "$REBUILD_RESULT"
}

while :; do
	# Returns when a service exits or a trapped signal arrives.
	wait -n || true
	check_running "${order[@]}"
	[ -z "$rebuild_requested" ] || rebuild_views
done
