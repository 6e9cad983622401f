#!/usr/bin/env bash
# pictures.sh — the images of docs/observability.md and docs/console.md,
# made from a real run: make run (with traces sent over OTLP) and make
# observe in a scratch run directory, a pool of 3 applied with a known
# traceparent, a few minutes of traffic through the gateway with a
# scale-up, a recycle and a ban, then headless Chromium screenshots of
#   - that pool.apply's trace, drawn from Jaeger's query API
#     (scripts/trace-waterfall.html; the Jaeger binary built from its Go
#     module serves no web UI),
#   - the fleet dashboard's main queries in Prometheus's graph page, and
#   - each page of make run's console (docs/img/console-*.png), after a
#     pool whose image no target offers is applied, so the fleet page shows
#     a condition; the sign-in page from a second console with a users
#     file. e2e/internal/consoleshots takes them in a browser that reaches
#     loopback only, and fails on a page that reports an error.
#
#   scripts/pictures.sh [OUT_DIR]     (default docs/img; make pictures)
#
# Needs what make run and make observe need, and chromium (Debian's
# package; make chromium-install). Uses ports 19090, 26686, 24317 and
# 24318 for Prometheus, Jaeger and OTLP, and kernel-chosen ports for
# everything else.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-docs/img}
CHROMIUM=${CHROMIUM:-chromium}
DURATION=${PICTURES_TRAFFIC_SECONDS:-150}
command -v "$CHROMIUM" >/dev/null || { echo "$CHROMIUM not found: apt-get install chromium" >&2; exit 1; }
mkdir -p "$OUT"
RUN=$(mktemp -d)
export PROXYFLEET_RUN_DIR=$RUN PROXYFLEET_NATS_ADDR=127.0.0.1:0 PROXYFLEET_ECHO_ADDR=127.0.0.1:0 \
	PROXYFLEET_GATEWAY_ADDR=127.0.0.1:0 PROXYFLEET_CONSOLE_ADDR=127.0.0.1:0 PROXYFLEET_PORTS=0 AGENT_FLAGS="--capacity 12" \
	PLANNER_FLAGS="--reconcile-interval 500ms" HEALTH_FLAGS="--probe-interval 2s"
export PROXYFLEET_PROMETHEUS_ADDR=127.0.0.1:19090 PROXYFLEET_JAEGER_ADDR=127.0.0.1:26686 \
	PROXYFLEET_OTLP_GRPC_ADDR=127.0.0.1:24317 PROXYFLEET_OTLP_HTTP_ADDR=127.0.0.1:24318
PROM=http://$PROXYFLEET_PROMETHEUS_ADDR
JAEGER=http://$PROXYFLEET_JAEGER_ADDR

pids=()
cleanup() {
	for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	./scripts/clean.sh stop "$RUN" >/dev/null 2>&1 || true
	rm -rf "$RUN"
}
trap cleanup EXIT

wait_for() { # wait_for SECONDS WHAT COMMAND...
	local until=$((SECONDS + $1)) what=$2
	shift 2
	until "$@" >/dev/null 2>&1; do
		if [ $SECONDS -ge $until ]; then echo "timed out waiting for $what" >&2; exit 1; fi
		sleep 0.5
	done
}

OTEL_EXPORTER_OTLP_ENDPOINT=http://$PROXYFLEET_OTLP_HTTP_ADDR PROXYFLEET_RUN_JOB=1 ./scripts/run.sh >"$RUN/run.out" 2>&1 &
pids+=($!)
wait_for 120 "make run's banner" grep -q "Press Ctrl-C" "$RUN/run.out"
PROXYFLEET_OBSERVE_JOB=1 ./scripts/observe.sh >"$RUN/observe.out" 2>&1 &
pids+=($!)
wait_for 120 "Prometheus" curl -sf "$PROM/-/ready"
wait_for 120 "Jaeger" curl -sf "$JAEGER/api/services"

# shellcheck disable=SC1091
. "$RUN/nats.env"
gateway=$(sed -n 's/^crawler gateway at http:\/\/\([^ ]*\).*/\1/p' "$RUN/run.out")
echo_url=$(sed -n 's/.*echo endpoint at \(http:[^,]*\),.*/\1/p' "$RUN/run.out")
console_url=$(sed -n 's/^console at \(http:[^ ]*[^/ ]\)\/\{0,1\} .*/\1/p' "$RUN/run.out")
trace_id=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
span_id=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
nats req -H "traceparent:00-$trace_id-$span_id-01" fleet.api.pool.apply \
	'{"name":"demo","provider":"local","size":3,"gateway":{"banRules":[{"name":"too-many","status":[429],"threshold":3}]}}' >/dev/null 2>&1
ready() { [ "$(nats req fleet.api.proxy.list '{"pool":"demo","limit":100}' 2>/dev/null | grep -o '"state":"ready"' | wc -l)" -ge "$1" ]; }
wait_for 120 "3 ready proxies" ready 3

# Traffic through the gateway for the graphs; midway a scale-up to 5, a
# recycle, and back to 3.
end=$((SECONDS + DURATION))
(while [ $SECONDS -lt $end ]; do curl -s -o /dev/null -x "http://demo:x@$gateway" "$echo_url" || true; done) &
traffic=$!
sleep $((DURATION / 3))
nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":5,"gateway":{"banRules":[{"name":"too-many","status":[429],"threshold":3}]}}' >/dev/null 2>&1
wait_for 120 "5 ready proxies" ready 5
id=$(nats req fleet.api.proxy.list '{"pool":"demo","limit":1}' 2>/dev/null | sed -n 's/.*"id":"\([^"]*\)".*/\1/p' | head -n 1)
nats req fleet.api.proxy.recycle "{\"id\":\"$id\"}" >/dev/null 2>&1 || true
sleep $((DURATION / 3))
nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":3,"gateway":{"banRules":[{"name":"too-many","status":[429],"threshold":3}]}}' >/dev/null 2>&1
wait "$traffic" || true
sleep 20 # two more scrapes after the last change

# The trace: Jaeger's JSON, drawn by trace-waterfall.html.
wait_for 60 "the trace in Jaeger" curl -sf "$JAEGER/api/traces/$trace_id"
curl -sf "$JAEGER/api/traces/$trace_id" >"$RUN/trace.json"
awk -v json="$RUN/trace.json" '
	/^const data = TRACE_JSON;/ { printf "const data = "; while ((getline line < json) > 0) printf "%s", line; print ";"; next }
	{ print }' scripts/trace-waterfall.html >"$RUN/trace.html"
shoot() { # shoot FILE URL [WIDTHxHEIGHT]
	"$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=15000 \
		--window-size="${3:-1400,900}" --screenshot="$1" "$2" >/dev/null 2>&1
	echo "wrote $1"
}
spans=$(grep -o '"operationName"' "$RUN/trace.json" | wc -l)
shoot "$OUT/trace-pool-apply.png" "file://$RUN/trace.html" "1400,$((140 + spans * 21))"

# The fleet dashboard's main graphs, as Prometheus draws them.
graph() { # graph FILE EXPR
	local q
	q=$(printf '%s' "$2" | od -An -tx1 | tr -d ' \n' | sed 's/../%&/g')
	shoot "$1" "$PROM/graph?g0.expr=$q&g0.tab=0&g0.range_input=$((DURATION / 60 + 2))m"
}
graph "$OUT/pool-desired-ready.png" '{__name__=~"proxyfleet_pool_(desired|ready)_proxies",pool="demo"}'
graph "$OUT/pool-states.png" 'sum by (state) (proxyfleet_pool_proxies{pool="demo"})'
graph "$OUT/gateway-requests.png" 'sum by (proxy) (rate(proxyfleet_gateway_requests_total{pool="demo"}[1m]))'
graph "$OUT/probe-latency-p95.png" 'histogram_quantile(0.95, sum by (le) (rate(proxyfleet_health_probe_duration_seconds_bucket[1m])))'
echo "trace $trace_id: $spans spans"

# The console's pages. A pool whose image no target offers shows why it
# has no proxy on the fleet page; a second console, with a users file,
# shows the sign-in page make run's console (no users: loopback, open)
# does not have.
nats req fleet.api.pool.apply '{"name":"geo","provider":"local","size":2,"image":"debian-13"}' >/dev/null 2>&1
hash=$(echo "pictures-only" | ./bin/console --hash-password)
printf 'ops:operator:%s\n' "$hash" >"$RUN/console-users"
./bin/console --nats-context "$RUN/nats/console.json" --data-dir "$RUN/console-login" --listen 127.0.0.1:0 \
	--users "$RUN/console-users" >"$RUN/console-login.log" 2>&1 &
pids+=($!)
wait_for 60 "the second console" grep -q '"msg":"console serving"' "$RUN/console-login.log"
login_url=http://$(sed -n 's/.*"msg":"console serving".*"listen":"\([^"]*\)".*/\1/p' "$RUN/console-login.log" | head -n 1)
# Traffic while the pages are taken, so the gateway's last minute has
# something to show: requests to the echo endpoint, and some to a loopback
# port the proxies' egress policy refuses (the failures).
end=$((SECONDS + 90))
(while [ $SECONDS -lt $end ]; do
	curl -s -o /dev/null -x "http://demo:x@$gateway" "$echo_url" || true
	curl -s -o /dev/null -x "http://demo:x@$gateway" "http://127.0.0.1:9/refused" || true
done) &
pids+=($!)
sleep 30
abs_out=$(cd "$OUT" && pwd)
(cd e2e && go run ./internal/consoleshots -base "$console_url" -out "$abs_out" \
	fleet=/ pool=/pools/demo targets=/targets events=/events gateway=/gateway)
(cd e2e && go run ./internal/consoleshots -base "$login_url" -out "$abs_out" login=/login)
