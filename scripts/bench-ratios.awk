# Reads `go test -bench` output and prints, for every benchmark that has a
# "baseline" sub-benchmark, each other sub-benchmark's ns/op (and rss-MB
# and fe-cpu-us/req, where reported) as a ratio of that baseline measured
# in the same run; then every fraction of a ceiling a benchmark reports
# itself (a metric whose unit ends in -x-ceiling, e.g.
# BenchmarkConvergeEndToEnd's running-x-ceiling and ready-x-ceiling).
/^Benchmark[^ ]*\/[^ ]* / {
	name = $1
	sub(/-[0-9]+$/, "", name)
	split(name, parts, "/")
	group = parts[1]
	leaf = substr(name, length(group) + 2)
	for (i = 2; i <= NF; i++) {
		if ($(i) == "ns/op") { ns[group SUBSEP leaf] += $(i - 1); nns[group SUBSEP leaf]++ }
		if ($(i) == "rss-MB") { rss[group SUBSEP leaf] += $(i - 1); nrss[group SUBSEP leaf]++ }
		if ($(i) == "fe-cpu-us/req") { fecpu[group SUBSEP leaf] += $(i - 1); nfecpu[group SUBSEP leaf]++ }
		if ($(i) ~ /-x-ceiling$/) ceil[++nceil] = sprintf("  %-56s %8.3f", name " " $(i), $(i - 1))
	}
	if (!(group in seen)) { seen[group] = 1; order[++n] = group }
	if (!((group SUBSEP leaf) in seenleaf)) { seenleaf[group SUBSEP leaf] = 1; leaves[group] = leaves[group] " " leaf }
}
# ratios prints each leaf's value over its group's baseline; a leaf run
# more than once (go test -count) counts as the mean of its runs.
function ratios(vals, runs, unit,    g, group, base, k, i, ls, v, note) {
	for (g = 1; g <= n; g++) {
		group = order[g]
		if (runs[group SUBSEP "baseline"] == 0) continue
		base = vals[group SUBSEP "baseline"] / runs[group SUBSEP "baseline"]
		if (base == 0) continue
		k = split(leaves[group], ls, " ")
		for (i = 1; i <= k; i++) {
			if (ls[i] == "baseline" || ls[i] == "") continue
			if (runs[group SUBSEP ls[i]] == 0) continue
			v = vals[group SUBSEP ls[i]] / runs[group SUBSEP ls[i]]
			note = ""
			if (runs[group SUBSEP ls[i]] > 1 || runs[group SUBSEP "baseline"] > 1) note = sprintf(", means of %d and %d runs", runs[group SUBSEP ls[i]], runs[group SUBSEP "baseline"])
			printf "  %-48s %8.2fx  (%.6g %s vs %.6g %s%s)\n", group "/" ls[i], v / base, v, unit, base, unit, note
		}
	}
}
END {
	print ""
	print "ratios against the baseline of the same run (lower is better):"
	ratios(ns, nns, "ns/op")
	ratios(rss, nrss, "rss-MB")
	ratios(fecpu, nfecpu, "fe-cpu-us/req")
	if (nceil > 0) {
		print ""
		print "fractions of the JetStream ceiling of the same run (higher is better):"
		for (i = 1; i <= nceil; i++) print ceil[i]
	}
}
