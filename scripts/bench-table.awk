# Reads `go test -bench` output and prints the scale table of docs/performance.md:
# one row per figure, measured against a limit from the same run (a
# baseline sub-benchmark) or a fixed goal, and their ratio.
#
#   row             measured                                  limit
#   converge-planner  BenchmarkConverge/converge proxies/s    BenchmarkConverge/baseline proxies/s (publish ceiling ÷ messages per proxy)
#                   (the planner alone, against stub agents that publish asynchronously; no health)
#   e2e-running     BenchmarkConvergeEndToEnd/converge running-proxies/s  BenchmarkConvergeEndToEnd/baseline proxies/s (the same ceiling, same run)
#   e2e-ready       BenchmarkConvergeEndToEnd/converge ready-proxies/s    the same
#                   (planner, four real agent runtimes, health probing and projecting: each its own process)
#   replay-planner  BenchmarkPlannerStart/replay events/s     BenchmarkPlannerStart/baseline events/s (bare ordered read)
#   start-snapshot  BenchmarkPlannerStart/snapshot events/s   the same bare read
#   rebuild-views   BenchmarkRebuildViews rebuild-events/s    its bare-events/s
#   replay          BenchmarkReplay/replay events/s           BenchmarkReplay/baseline events/s
#   probes          BenchmarkProbes/scheduled probes/s        BenchmarkProbes/baseline probes/s (bare probe loop)
#   probe-replicas  BenchmarkProbeReplicas/two probes/s        BenchmarkProbeReplicas/baseline probes/s (one replica)
#   probe-p99-late  BenchmarkProbes/fleet-15s p99-late-ms     1000 ms (goal)
#   view-lag        BenchmarkLiveLag lag-ms                   1000 ms (goal)
#   gw-vs-squid     BenchmarkFrontEndVsSquid/gateway req/s    BenchmarkFrontEndVsSquid/baseline req/s (Squid, round-robin parents)
#   gw-vs-haproxy   BenchmarkFrontEndVsHAProxy/gateway req/s  BenchmarkFrontEndVsHAProxy/baseline req/s (HAProxy, roundrobin backend)
#   rss-<service>   BenchmarkIdleRSS/<service> rss-MB         25 MB (goal)
/^Benchmark/ {
	name = $1
	sub(/-[0-9]+$/, "", name)
	for (i = 3; i + 1 <= NF; i += 2) v[name SUBSEP $(i + 1)] = $(i)
	if (name ~ /^BenchmarkIdleRSS\//) { svc = substr(name, length("BenchmarkIdleRSS/") + 1); rss[++nrss] = svc }
}
function row(label, m, l, unit, lunit, better,    r) {
	if (m == "" || l == "") return
	r = (l + 0 == 0) ? 0 : m / l
	printf "  %-16s %14.1f %-12s %14.1f %-12s %7.2f  %s\n", label, m, unit, l, lunit, r, better
}
END {
	print ""
	printf "  %-16s %27s %27s %7s\n", "figure", "measured", "limit", "ratio"
	row("converge-planner", v["BenchmarkConverge/converge" SUBSEP "proxies/s"], v["BenchmarkConverge/baseline" SUBSEP "proxies/s"], "proxies/s", "proxies/s", "(planner only, stub agents; goal >= 0.25, >= 5000/s)")
	row("e2e-running", v["BenchmarkConvergeEndToEnd/converge" SUBSEP "running-proxies/s"], v["BenchmarkConvergeEndToEnd/baseline" SUBSEP "proxies/s"], "proxies/s", "proxies/s", "(whole system, apply to all running in the log; goal >= 0.25)")
	row("e2e-ready", v["BenchmarkConvergeEndToEnd/converge" SUBSEP "ready-proxies/s"], v["BenchmarkConvergeEndToEnd/baseline" SUBSEP "proxies/s"], "proxies/s", "proxies/s", "(whole system, apply to all ready in fleet-proxies; goal >= 0.15)")
	row("replay-planner", v["BenchmarkPlannerStart/replay" SUBSEP "events/s"], v["BenchmarkPlannerStart/baseline" SUBSEP "events/s"], "events/s", "events/s", "(higher is better)")
	row("start-snapshot", v["BenchmarkPlannerStart/snapshot" SUBSEP "events/s"], v["BenchmarkPlannerStart/baseline" SUBSEP "events/s"], "events/s", "events/s", "(log events covered per second of start)")
	row("rebuild-views", v["BenchmarkRebuildViews" SUBSEP "rebuild-events/s"], v["BenchmarkRebuildViews" SUBSEP "bare-events/s"], "events/s", "events/s", "(goal >= 0.25)")
	row("replay", v["BenchmarkReplay/replay" SUBSEP "events/s"], v["BenchmarkReplay/baseline" SUBSEP "events/s"], "events/s", "events/s", "(goal >= 0.25)")
	row("probes", v["BenchmarkProbes/scheduled" SUBSEP "probes/s"], v["BenchmarkProbes/baseline" SUBSEP "probes/s"], "probes/s", "probes/s", "(goal >= 5000/s)")
	row("probe-replicas", v["BenchmarkProbeReplicas/two" SUBSEP "probes/s"], v["BenchmarkProbeReplicas/baseline" SUBSEP "probes/s"], "probes/s", "probes/s", "(two health replicas against one, same cores)")
	row("probe-p99-late", v["BenchmarkProbes/fleet-15s" SUBSEP "p99-late-ms"], 1000, "ms", "ms", "(goal < 1; 10k proxies every 15 s)")
	row("view-lag", v["BenchmarkLiveLag" SUBSEP "lag-ms"], 1000, "ms", "ms", "(goal < 1; 10k-proxy burst)")
	row("gw-vs-squid", v["BenchmarkFrontEndVsSquid/gateway" SUBSEP "req/s"], v["BenchmarkFrontEndVsSquid/baseline" SUBSEP "req/s"], "req/s", "req/s", "(gateway against Squid, 3 proxies, 32 clients; goal >= 1)")
	row("gw-vs-haproxy", v["BenchmarkFrontEndVsHAProxy/gateway" SUBSEP "req/s"], v["BenchmarkFrontEndVsHAProxy/baseline" SUBSEP "req/s"], "req/s", "req/s", "(gateway against HAProxy, the same; goal >= 1)")
	for (i = 1; i <= nrss; i++)
		row("rss-" rss[i], v["BenchmarkIdleRSS/" rss[i] SUBSEP "rss-MB"], 25, "MB", "MB", "(goal <= 1)")
}
