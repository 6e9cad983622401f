#!/usr/bin/env bash
# observe.sh — make observe: a real Prometheus (Debian's package) scraping
# make run's services and a real Jaeger v2 receiving their traces over
# OTLP, both on loopback, until Ctrl-C.
#
# Prometheus reads <run-dir>/metrics-targets.json, which make run writes
# (file_sd: targets follow a restarted make run), evaluates the recording
# rules and alerts of deploy/prometheus/rules, and keeps its data under
# <run-dir>/observe/prometheus. Jaeger keeps traces in memory.
#
# Knobs (environment):
#   PROXYFLEET_RUN_DIR          make run's state directory (.run)
#   PROXYFLEET_BIN              where jaeger is (./bin)
#   PROXYFLEET_PROMETHEUS_ADDR  Prometheus's UI and API (127.0.0.1:9090)
#   PROXYFLEET_JAEGER_ADDR      Jaeger's UI and query API (127.0.0.1:16686)
#   PROXYFLEET_OTLP_GRPC_ADDR   Jaeger's OTLP/gRPC receiver (127.0.0.1:4317)
#   PROXYFLEET_OTLP_HTTP_ADDR   Jaeger's OTLP/HTTP receiver (127.0.0.1:4318)
#   PROMETHEUS                  the prometheus binary (/usr/bin/prometheus)
#
# make run's services send traces when started with
#   OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 make run
set -euo pipefail
cd "$(dirname "$0")/.."

# As in run.sh: on a terminal, run as a job of its own so that Ctrl-C
# reaches this script and not make.
if [ -t 0 ] && [ -z "${PROXYFLEET_OBSERVE_JOB:-}" ]; then
	set -m
	PROXYFLEET_OBSERVE_JOB=1 "$0" "$@" && exit 0 || exit $?
fi

BIN=${PROXYFLEET_BIN:-./bin}
RUN=${PROXYFLEET_RUN_DIR:-.run}
PROM_ADDR=${PROXYFLEET_PROMETHEUS_ADDR:-127.0.0.1:9090}
JAEGER_ADDR=${PROXYFLEET_JAEGER_ADDR:-127.0.0.1:16686}
OTLP_GRPC=${PROXYFLEET_OTLP_GRPC_ADDR:-127.0.0.1:4317}
OTLP_HTTP=${PROXYFLEET_OTLP_HTTP_ADDR:-127.0.0.1:4318}
PROMETHEUS=${PROMETHEUS:-/usr/bin/prometheus}
JAEGER=$BIN/jaeger

for b in "$PROMETHEUS" "$JAEGER"; do
	if [ ! -x "$b" ]; then
		echo "$b is missing: start make observe, which installs prometheus and builds jaeger" >&2
		exit 1
	fi
done
for a in "$PROM_ADDR" "$JAEGER_ADDR" "$OTLP_GRPC" "$OTLP_HTTP"; do
	if (exec 3<>"/dev/tcp/${a%:*}/${a##*:}") 2>/dev/null; then
		echo "something already listens on $a; stop it, or set the PROXYFLEET_*_ADDR of docs/observability.md" >&2
		exit 1
	fi
done

OBS=$RUN/observe
mkdir -p "$OBS" "$RUN/logs"
abs_run=$(cd "$RUN" && pwd)
abs_rules=$(cd deploy/prometheus/rules && pwd)
PIDFILE=$OBS/observe.pid
if pid=$(cat "$PIDFILE" 2>/dev/null) && [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q 'scripts/observe\.sh'; then
	echo "make observe already runs for $RUN (pid $pid)" >&2
	exit 1
fi
echo $$ >"$PIDFILE"

# Prometheus: make run's services through file_sd, each target's service
# label as its job; scraped every 5s so a local run shows at once.
cat >"$OBS/prometheus.yml" <<EOT
# Written by make observe (scripts/observe.sh); rewritten at each start.
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - $abs_rules/recording.yml
  - $abs_rules/alerts.yml
scrape_configs:
  - job_name: proxyfleet
    file_sd_configs:
      - files: ["$abs_run/metrics-targets.json"]
        refresh_interval: 5s
    relabel_configs:
      - source_labels: [service]
        target_label: job
EOT

# Jaeger v2: OTLP in, traces in memory, the UI and query API out. Its own
# metrics are off (the collector's default endpoint, :8888, is make run's
# gateway port).
cat >"$OBS/jaeger.yaml" <<EOT
# Written by make observe (scripts/observe.sh); rewritten at each start.
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    resource:
      service.name: jaeger
    metrics:
      level: none
    logs:
      level: info
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    # Its own query spans would go over OTLP to :4317, itself.
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: $JAEGER_ADDR
    grpc:
      endpoint: ${JAEGER_ADDR%:*}:0
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: $OTLP_GRPC
      http:
        endpoint: $OTLP_HTTP
processors:
  batch: {}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
EOT

declare -A pid=()
order=(prometheus jaeger)

exited() {
	local stat
	stat=$( { cat "/proc/$1/stat"; } 2>/dev/null) || return 0
	stat=${stat##*) }
	case "${stat%% *}" in Z | X) return 0 ;; esac
	return 1
}

stop_one() {
	local name=$1 p=${pid[$1]:-}
	[ -n "$p" ] || return 0
	kill -TERM "$p" 2>/dev/null || true
	for _ in $(seq 1 150); do
		exited "$p" && break
		sleep 0.1
	done
	exited "$p" || kill -KILL "$p" 2>/dev/null || true
	wait "$p" 2>/dev/null || true
	unset "pid[$name]"
}

stopped=""
stop_all() {
	[ -z "$stopped" ] || return 0
	stopped=1
	trap '' INT TERM
	stop_one jaeger
	stop_one prometheus
	rm -f "$PIDFILE"
}
on_signal() {
	if [ -t 1 ]; then echo; fi
	trap - EXIT
	stop_all
	echo "stopped Prometheus and Jaeger (Prometheus's data stays in $OBS/prometheus)"
	exit 0
}
trap on_signal INT TERM
trap 'stop_all' EXIT

start() {
	local name=$1
	shift
	setsid "$@" </dev/null >>"$RUN/logs/$name.log" 2>&1 &
	pid[$name]=$!
}

# wait_http NAME URL: until URL answers 200, or NAME exits.
wait_http() {
	local name=$1 url=$2
	for _ in $(seq 1 600); do
		if curl -fsS -o /dev/null "$url" 2>/dev/null; then return 0; fi
		if exited "${pid[$name]}"; then
			echo "$name exited; last lines of $RUN/logs/$name.log:" >&2
			tail -n 20 "$RUN/logs/$name.log" | sed 's/^/  /' >&2
			exit 1
		fi
		sleep 0.1
	done
	echo "$name did not answer $url within 60s; see $RUN/logs/$name.log" >&2
	exit 1
}

start prometheus "$PROMETHEUS" --config.file="$OBS/prometheus.yml" \
	--storage.tsdb.path="$OBS/prometheus" --storage.tsdb.retention.time=2d \
	--web.listen-address="$PROM_ADDR"
start jaeger "$JAEGER" --config "$OBS/jaeger.yaml"
wait_http prometheus "http://$PROM_ADDR/-/ready"
wait_http jaeger "http://$JAEGER_ADDR/api/services"

# Where make run's services send their traces: its environment.
traces="make run is not running with its state in $RUN: start it with
  OTEL_EXPORTER_OTLP_ENDPOINT=http://$OTLP_HTTP make run
and Prometheus finds its services as soon as it writes $RUN/metrics-targets.json."
if run_pid=$(cat "$RUN/run.pid" 2>/dev/null) && [ -r "/proc/$run_pid/environ" ]; then
	endpoint=$(tr '\0' '\n' <"/proc/$run_pid/environ" | sed -n 's/^OTEL_EXPORTER_OTLP_ENDPOINT=//p' | head -n 1)
	case "$endpoint" in
	"") traces="make run (pid $run_pid) sends no traces: stop it and start it with
  OTEL_EXPORTER_OTLP_ENDPOINT=http://$OTLP_HTTP make run" ;;
	"http://$OTLP_HTTP" | "http://$OTLP_HTTP/" | "http://$OTLP_GRPC" | "http://$OTLP_GRPC/") traces="make run (pid $run_pid) sends its traces here ($endpoint)." ;;
	*) traces="make run (pid $run_pid) sends its traces to $endpoint, not here; restart it with
  OTEL_EXPORTER_OTLP_ENDPOINT=http://$OTLP_HTTP make run" ;;
	esac
fi

cat <<EOT

Prometheus at http://$PROM_ADDR (targets: http://$PROM_ADDR/targets, alerts: http://$PROM_ADDR/alerts),
scraping the services in $RUN/metrics-targets.json with the rules of deploy/prometheus/rules.
Jaeger at http://$JAEGER_ADDR (API: http://$JAEGER_ADDR/api/services), OTLP on http://$OTLP_HTTP and grpc $OTLP_GRPC.
$traces

Logs: $RUN/logs/prometheus.log, $RUN/logs/jaeger.log. Press Ctrl-C to stop.
EOT

while :; do
	wait -n || true
	for name in "${order[@]}"; do
		if [ -n "${pid[$name]:-}" ] && exited "${pid[$name]}"; then
			unset "pid[$name]"
			{
				echo "$name exited unexpectedly; last lines of $RUN/logs/$name.log:"
				tail -n 20 "$RUN/logs/$name.log" | sed 's/^/  /'
			} >&2
			trap - EXIT
			stop_all
			exit 1
		fi
	done
done
