#!/usr/bin/env bash
# Starts the whole system on one machine: the planner (hosting the embedded
# NATS server), the health service and a local-agent, each as its own
# process, with state under ./.run. Ctrl-C stops them all; proxy processes
# keep running and are found again by the next `make run` (see docs).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=./bin
RUN=${PROXYFLEET_RUN_DIR:-.run}
NATS_ADDR=${PROXYFLEET_NATS_ADDR:-127.0.0.1:4222}
NATS_URL="nats://$NATS_ADDR"
ECHO_ADDR=${PROXYFLEET_ECHO_ADDR:-127.0.0.1:8480}
PORTS=${PROXYFLEET_PORTS:-20000-20999}
mkdir -p "$RUN/logs"

pids=()
stop() {
	trap - INT TERM EXIT
	echo
	echo "stopping services..."
	for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[$i]}" 2>/dev/null || true; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
	echo "stopped. Proxy processes keep running; run 'make run' again to manage them, delete their pools first, or stop them with 'make clean-proxies'."
}
trap stop INT TERM EXIT

if (exec 3<>"/dev/tcp/${NATS_ADDR%:*}/${NATS_ADDR##*:}") 2>/dev/null; then
	echo "something already listens on $NATS_ADDR; stop it or set PROXYFLEET_NATS_ADDR" >&2
	exit 1
fi

start() {
	local name=$1
	shift
	"$BIN/$name" "$@" >>"$RUN/logs/$name.log" 2>&1 &
	pids+=($!)
	echo "started $name (pid $!, log $RUN/logs/$name.log)"
}

start planner --data-dir "$RUN/planner" --nats-listen "$NATS_ADDR"
for _ in $(seq 1 100); do
	if "$BIN/nats" --server "$NATS_URL" account info >/dev/null 2>&1; then break; fi
	if ! kill -0 "${pids[0]}" 2>/dev/null; then
		echo "planner exited; last log lines:" >&2
		tail -n 20 "$RUN/logs/planner.log" >&2
		exit 1
	fi
	sleep 0.1
done
start health --nats-url "$NATS_URL" --data-dir "$RUN/health" --echo-addr "$ECHO_ADDR"
start local-agent --nats-url "$NATS_URL" --data-dir "$RUN/local-agent" --ports "$PORTS"

cat <<EOT

proxyfleet is running: embedded NATS at $NATS_URL, echo endpoint at http://$ECHO_ADDR/
Use the pinned nats CLI from ./bin (export PATH="\$PWD/bin:\$PATH") in another terminal:

  nats micro ls                                    # planner, health's agents: the fleet's services
  nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":3}'
  nats kv watch fleet-proxies                      # watch proxies go requested -> running -> ready
  nats req fleet.api.proxy.list '{"pool":"demo"}'  # ids and addresses
  curl -x http://<address> http://$ECHO_ADDR/      # a request through one proxy (address from the list)
  nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":1}'   # scale down
  nats req fleet.api.pool.delete '{"name":"demo"}'
  nats stream view FLEET_EVENTS                    # the event log, the source of truth

Logs: $RUN/logs/. Press Ctrl-C to stop.
EOT

while :; do
	for pid in "${pids[@]}"; do
		if ! kill -0 "$pid" 2>/dev/null; then
			echo "a service (pid $pid) exited; see $RUN/logs/" >&2
			exit 1
		fi
	done
	sleep 1
done
