# Reads `go test -bench` output and prints, for every benchmark that has a
# "baseline" sub-benchmark, each other sub-benchmark's ns/op (and rss-MB,
# where reported) as a ratio of that baseline measured in the same run;
# then every fraction of a ceiling a benchmark reports itself (a metric
# whose unit ends in -x-ceiling, e.g. BenchmarkConvergeEndToEnd's
# running-x-ceiling and ready-x-ceiling).
/^Benchmark[^ ]*\/[^ ]* / {
	name = $1
	sub(/-[0-9]+$/, "", name)
	split(name, parts, "/")
	group = parts[1]
	leaf = substr(name, length(group) + 2)
	for (i = 2; i <= NF; i++) {
		if ($(i) == "ns/op") ns[group SUBSEP leaf] = $(i - 1)
		if ($(i) == "rss-MB") rss[group SUBSEP leaf] = $(i - 1)
		if ($(i) ~ /-x-ceiling$/) ceil[++nceil] = sprintf("  %-56s %8.3f", name " " $(i), $(i - 1))
	}
	if (!(group in seen)) { seen[group] = 1; order[++n] = group }
	leaves[group] = leaves[group] " " leaf
}
function ratios(vals, unit,    g, group, base, k, i, ls, v) {
	for (g = 1; g <= n; g++) {
		group = order[g]
		base = vals[group SUBSEP "baseline"]
		if (base == "" || base == 0) continue
		k = split(leaves[group], ls, " ")
		for (i = 1; i <= k; i++) {
			if (ls[i] == "baseline" || ls[i] == "") continue
			v = vals[group SUBSEP ls[i]]
			if (v == "") continue
			printf "  %-48s %8.2fx  (%s %s vs %s %s)\n", group "/" ls[i], v / base, v, unit, base, unit
		}
	}
}
END {
	print ""
	print "ratios against the baseline of the same run (lower is better):"
	ratios(ns, "ns/op")
	ratios(rss, "rss-MB")
	if (nceil > 0) {
		print ""
		print "fractions of the JetStream ceiling of the same run (higher is better):"
		for (i = 1; i <= nceil; i++) print ceil[i]
	}
}
