package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"
	"unicode"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// The dashboards (deploy/grafana) and the rules (deploy/prometheus) are
// checked against what the services emit: every metric name and label
// their PromQL names must be exported by some service of a running system.

// promqlRef is what one PromQL expression refers to: the metric names it
// selects, the labels each selector matches on, and the labels it groups
// or matches by (by, without, on, ignoring, group_left, group_right).
type promqlRef struct {
	Metrics  []string            // sorted, distinct
	Matchers map[string][]string // metric -> labels of its {matchers}, sorted
	Grouping []string            // sorted, distinct
}

// promqlFuncs are PromQL's functions and aggregation operators: an
// identifier followed by "(" must be one of them.
var promqlFuncs = map[string]bool{}

func init() {
	for _, f := range strings.Fields(`
		sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
		abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week
		day_of_year days_in_month delta deriv exp floor histogram_avg histogram_count histogram_fraction
		histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters double_exponential_smoothing
		hour idelta increase irate label_join label_replace ln log2 log10 minute month predict_linear
		rate resets round scalar sgn sort sort_desc sort_by_label sort_by_label_desc sqrt time timestamp vector year
		avg_over_time min_over_time max_over_time sum_over_time count_over_time quantile_over_time
		stddev_over_time stdvar_over_time last_over_time present_over_time mad_over_time
		acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh deg pi rad info`) {
		promqlFuncs[f] = true
	}
}

// promqlKeywords are identifiers that are neither metrics nor functions.
var promqlKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "atan2": true, "bool": true, "offset": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"inf": true, "nan": true, "start": true, "end": true, "step": true,
}

// promqlGrouping are the keywords followed by a list of label names.
var promqlGrouping = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// parsePromQL extracts the references of expr. It tokenizes PromQL enough
// for that: strings, ranges and subqueries ([...], which may hold a
// Grafana variable such as $__rate_interval), numbers and durations are
// skipped; an identifier followed by "(" is a function (an unknown one is
// an error), one of the keywords is not a metric, and any other is a
// metric name, with the {matchers} that may follow it.
func parsePromQL(expr string) (promqlRef, error) {
	metrics := map[string]bool{}
	matchers := map[string]map[string]bool{}
	grouping := map[string]bool{}
	s := []rune(expr)
	i := 0
	skipSpace := func() {
		for i < len(s) && unicode.IsSpace(s[i]) {
			i++
		}
	}
	isIdentStart := func(r rune) bool { return r == '_' || r == ':' || unicode.IsLetter(r) }
	isIdent := func(r rune) bool { return isIdentStart(r) || unicode.IsDigit(r) }
	ident := func() string {
		start := i
		for i < len(s) && isIdent(s[i]) {
			i++
		}
		return string(s[start:i])
	}
	skipString := func() error {
		q := s[i]
		i++
		for i < len(s) && s[i] != q {
			if s[i] == '\\' && q != '`' {
				i++
			}
			i++
		}
		if i >= len(s) {
			return fmt.Errorf("unterminated string in %q", expr)
		}
		i++
		return nil
	}
	// labelList reads "(a, b)" after a grouping keyword.
	labelList := func() error {
		i++ // (
		for {
			skipSpace()
			if i >= len(s) {
				return fmt.Errorf("unterminated label list in %q", expr)
			}
			switch {
			case s[i] == ')':
				i++
				return nil
			case s[i] == ',':
				i++
			case isIdentStart(s[i]):
				grouping[ident()] = true
			default:
				return fmt.Errorf("unexpected %q in a label list of %q", s[i], expr)
			}
		}
	}
	// selector reads "{label op value, ...}" for metric ("" when the
	// selector has no name before it: __name__ gives it).
	selector := func(metric string) error {
		i++ // {
		var labels []string
		for {
			skipSpace()
			if i >= len(s) {
				return fmt.Errorf("unterminated selector in %q", expr)
			}
			if s[i] == '}' {
				i++
				break
			}
			if s[i] == ',' {
				i++
				continue
			}
			if s[i] == '"' || s[i] == '\'' || s[i] == '`' {
				// A quoted metric name (Prometheus 3): {"name", ...}.
				start := i
				if err := skipString(); err != nil {
					return err
				}
				metric = strings.Trim(string(s[start:i]), "\"'`")
				continue
			}
			if !isIdentStart(s[i]) {
				return fmt.Errorf("unexpected %q in a selector of %q", s[i], expr)
			}
			label := ident()
			skipSpace()
			op := ""
			for i < len(s) && strings.ContainsRune("=!~", s[i]) {
				op += string(s[i])
				i++
			}
			if op != "=" && op != "!=" && op != "=~" && op != "!~" {
				return fmt.Errorf("label %s without a matcher in %q", label, expr)
			}
			skipSpace()
			if i >= len(s) || (s[i] != '"' && s[i] != '\'' && s[i] != '`') {
				return fmt.Errorf("label %s: the value is not a string in %q", label, expr)
			}
			start := i
			if err := skipString(); err != nil {
				return err
			}
			if label == "__name__" && op == "=" {
				metric = strings.Trim(string(s[start:i]), "\"'`")
				continue
			}
			labels = append(labels, label)
		}
		if metric == "" {
			return fmt.Errorf("a selector without a metric name in %q", expr)
		}
		metrics[metric] = true
		if matchers[metric] == nil {
			matchers[metric] = map[string]bool{}
		}
		for _, l := range labels {
			matchers[metric][l] = true
		}
		return nil
	}
	for {
		skipSpace()
		if i >= len(s) {
			break
		}
		r := s[i]
		switch {
		case r == '"' || r == '\'' || r == '`':
			if err := skipString(); err != nil {
				return promqlRef{}, err
			}
		case r == '[':
			depth := 0
			for ; i < len(s); i++ {
				if s[i] == '[' {
					depth++
				} else if s[i] == ']' {
					depth--
					if depth == 0 {
						break
					}
				}
			}
			if i >= len(s) {
				return promqlRef{}, fmt.Errorf("unterminated range in %q", expr)
			}
			i++
		case r == '{':
			if err := selector(""); err != nil {
				return promqlRef{}, err
			}
		case r == '$':
			// A Grafana variable outside a range ($pool in a matcher is a
			// string): skip its name.
			i++
			ident()
		case unicode.IsDigit(r) || (r == '.' && i+1 < len(s) && unicode.IsDigit(s[i+1])):
			// Numbers and durations: 0.95, 1e3, 5m, 0x1f.
			for i < len(s) && (isIdent(s[i]) || s[i] == '.') {
				i++
			}
		case isIdentStart(r):
			name := ident()
			skipSpace()
			next := rune(0)
			if i < len(s) {
				next = s[i]
			}
			lower := strings.ToLower(name)
			switch {
			case promqlGrouping[lower] && next == '(':
				if err := labelList(); err != nil {
					return promqlRef{}, err
				}
			case promqlKeywords[lower]:
			case promqlFuncs[name] && isIdentStart(next) && aggregationModifier(s[i:]):
				// sum by (a) (...): the aggregation's labels come first.
			case next == '(':
				if !promqlFuncs[name] {
					return promqlRef{}, fmt.Errorf("unknown function %s in %q", name, expr)
				}
			case next == '{':
				if err := selector(name); err != nil {
					return promqlRef{}, err
				}
			default:
				metrics[name] = true
			}
		default:
			// Operators and parentheses.
			i++
		}
	}
	ref := promqlRef{Metrics: sortedKeys(metrics), Matchers: map[string][]string{}, Grouping: sortedKeys(grouping)}
	for m, ls := range matchers {
		ref.Matchers[m] = sortedKeys(ls)
	}
	return ref, nil
}

// aggregationModifier reports whether rest starts with "by" or "without"
// and a "(" (any case, spaces between).
func aggregationModifier(rest []rune) bool {
	w := strings.ToLower(strings.TrimLeftFunc(string(rest), unicode.IsSpace))
	for _, kw := range []string{"by", "without"} {
		if after, ok := strings.CutPrefix(w, kw); ok && strings.HasPrefix(strings.TrimLeftFunc(after, unicode.IsSpace), "(") {
			return true
		}
	}
	return false
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func TestParsePromQL(t *testing.T) {
	for _, tc := range []struct {
		expr     string
		metrics  string // space separated
		matchers string // metric:label,label ...
		grouping string
		err      string
	}{
		{expr: `up`, metrics: "up"},
		{expr: `sum by (verb, outcome) (rate(proxyfleet_agent_commands_total[5m]))`,
			metrics: "proxyfleet_agent_commands_total", grouping: "outcome verb"},
		{expr: `sum(rate(x_total{outcome="failed", pool=~"a|b"}[$__rate_interval])) without (instance)`,
			metrics: "x_total", matchers: "x_total:outcome,pool", grouping: "instance"},
		{expr: `histogram_quantile(0.95, sum by (le) (rate(d_seconds_bucket[5m])))`,
			metrics: "d_seconds_bucket", grouping: "le"},
		{expr: "a > 60\nor (max by (e, t) (max_over_time(a[1h])) unless max by (e, t) (a))\nor (absent(a) and on () (max(b) == 1))",
			metrics: "a b", grouping: "e t"},
		{expr: `rate(c_total[5m] offset 1h) / ignoring(code) group_left(pool) d`,
			metrics: "c_total d", grouping: "code pool"},
		{expr: `x unless x offset 15m`, metrics: "x"},
		{expr: `proxyfleet:pool_ready_proxies:max < proxyfleet:pool_desired_proxies:max`,
			metrics: "proxyfleet:pool_desired_proxies:max proxyfleet:pool_ready_proxies:max"},
		{expr: `{__name__="m", job="planner"}`, metrics: "m", matchers: "m:job"},
		{expr: `label_replace(m, "dst", "$1", "src", "(.*)") > bool 1e3`, metrics: "m"},
		{expr: `count(m{a!="x}y", b!~'q'}) BY (a)`, metrics: "m", matchers: "m:a,b", grouping: "a"},
		{expr: `max_over_time(m[10m:1m]) @ end()`, metrics: "m"},
		{expr: `sum(rate(m[5m]`, metrics: "m"}, // unbalanced parentheses are not its business
		{expr: `nosuchfunc(m)`, err: "unknown function nosuchfunc"},
		{expr: `m{a}`, err: "label a without a matcher"},
		{expr: `m{a="x`, err: "unterminated"},
		{expr: `rate(m[5m)`, err: "unterminated range"},
	} {
		got, err := parsePromQL(tc.expr)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("parsePromQL(%q) error %v; want one containing %q", tc.expr, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("parsePromQL(%q): %v", tc.expr, err)
			continue
		}
		if g := strings.Join(got.Metrics, " "); g != tc.metrics {
			t.Errorf("parsePromQL(%q) metrics %q; want %q", tc.expr, g, tc.metrics)
		}
		var ms []string
		for _, m := range got.Metrics {
			if ls := got.Matchers[m]; len(ls) > 0 {
				ms = append(ms, m+":"+strings.Join(ls, ","))
			}
		}
		if g := strings.Join(ms, " "); g != tc.matchers {
			t.Errorf("parsePromQL(%q) matchers %q; want %q", tc.expr, g, tc.matchers)
		}
		if g := strings.Join(got.Grouping, " "); g != tc.grouping {
			t.Errorf("parsePromQL(%q) grouping %q; want %q", tc.expr, g, tc.grouping)
		}
	}
}

// query is one PromQL expression of a dashboard or rule file, with where
// it is.
type query struct {
	where  string
	expr   string
	record string // the series a recording rule writes, "" otherwise
}

// repoPath is path under the repository (the tests run in e2e/).
func repoPath(path string) string { return filepath.Join("..", path) }

// dashboardQueries returns the expr of every target of every dashboard
// in deploy/grafana/dashboards.
func dashboardQueries(t *testing.T) []query {
	t.Helper()
	files, err := filepath.Glob(repoPath("deploy/grafana/dashboards/*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no dashboards in deploy/grafana/dashboards (%v)", err)
	}
	var out []query
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		var doc any
		if err := json.Unmarshal(b, &doc); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		var walk func(v any, where string)
		walk = func(v any, where string) {
			switch v := v.(type) {
			case map[string]any:
				if title, ok := v["title"].(string); ok {
					where = filepath.Base(file) + ": " + title
				}
				for k, x := range v {
					if e, ok := x.(string); ok && k == "expr" {
						out = append(out, query{where: where, expr: e})
						continue
					}
					walk(x, where)
				}
			case []any:
				for _, x := range v {
					walk(x, where)
				}
			}
		}
		walk(doc, filepath.Base(file))
	}
	return out
}

// ruleQueries returns the expr of every rule in deploy/prometheus/rules
// (the rule files, not their tests). The files are YAML as promtool reads
// it; this reads the subset they use: "- record: name" or "- alert: name"
// items, each with "expr:" on one line or as a block scalar ("|", ">").
// promtool check rules (make test-prometheus-rules) checks the YAML
// itself; the count of items read here is checked against the count of
// rule items in the file.
func ruleQueries(t *testing.T) []query {
	t.Helper()
	files, err := filepath.Glob(repoPath("deploy/prometheus/rules/*.yml"))
	if err != nil {
		t.Fatal(err)
	}
	item := regexp.MustCompile(`^\s*-\s+(record|alert):\s*(\S+)\s*$`)
	exprLine := regexp.MustCompile(`^(\s*)expr:\s*(.*)$`)
	var out []query
	for _, file := range files {
		if strings.HasSuffix(file, "_test.yml") {
			continue
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		items, kind, name := 0, "", ""
		for n := 0; n < len(lines); n++ {
			if m := item.FindStringSubmatch(lines[n]); m != nil {
				items++
				kind, name = m[1], m[2]
				continue
			}
			m := exprLine.FindStringSubmatch(lines[n])
			if m == nil {
				continue
			}
			where := fmt.Sprintf("%s: %s %s", filepath.Base(file), kind, name)
			expr := strings.TrimSpace(m[2])
			if expr == "|" || expr == ">" || expr == "|-" || expr == ">-" {
				indent := len(m[1])
				var block []string
				for n+1 < len(lines) {
					l := lines[n+1]
					if strings.TrimSpace(l) != "" && len(l)-len(strings.TrimLeft(l, " ")) <= indent {
						break
					}
					block = append(block, l)
					n++
				}
				expr = strings.Join(block, "\n")
			} else if len(expr) > 1 && (expr[0] == '"' || expr[0] == '\'') {
				t.Fatalf("%s: quote-free expr expected (this reader does not unquote YAML)", where)
			}
			q := query{where: where, expr: strings.TrimSpace(expr)}
			if kind == "record" {
				q.record = name
			}
			out = append(out, q)
		}
		if got := countExprs(out, filepath.Base(file)); got != items {
			t.Fatalf("%s: read %d exprs for %d rules", file, got, items)
		}
	}
	if len(out) == 0 {
		t.Fatal("no rules in deploy/prometheus/rules")
	}
	return out
}

func countExprs(qs []query, file string) int {
	n := 0
	for _, q := range qs {
		if strings.HasPrefix(q.where, file+":") {
			n++
		}
	}
	return n
}

// scrapeLabels are the labels Prometheus adds to every scraped series
// (job, instance) and the one deploy/prometheus and make observe give each
// target (service).
var scrapeLabels = map[string]bool{"job": true, "instance": true, "service": true}

// exposition is what the services export: metric name -> its label names.
type exposition map[string]map[string]bool

var seriesLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s`)
var labelName = regexp.MustCompile(`(?:^|,)\s*([a-zA-Z_][a-zA-Z0-9_]*)="`)

// add reads one /metrics body (Prometheus text format) into e.
func (e exposition) add(body string) {
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		m := seriesLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		if e[m[1]] == nil {
			e[m[1]] = map[string]bool{}
		}
		// Label values are quoted strings that may hold commas and
		// quotes: drop them before reading the names.
		for _, l := range labelName.FindAllStringSubmatch(stripLabelValues(m[3]), -1) {
			e[m[1]][l[1]] = true
		}
	}
}

// stripLabelValues turns a="x,\"y" into a="" so names can be read.
func stripLabelValues(s string) string {
	var b strings.Builder
	in := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case in && c == '\\':
			i++
		case in && c == '"':
			in = false
			b.WriteByte(c)
		case in:
		case c == '"':
			in = true
			b.WriteByte(c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

func TestExpositionLabels(t *testing.T) {
	e := exposition{}
	e.add("# HELP x_total X.\n# TYPE x_total counter\n" +
		`x_total{otel_scope_name="a",pool="p,q=\"r\"",reason="z"} 3` + "\n" +
		"up 1\n" + `d_bucket{le="0.5"} 1 1700000000000` + "\n")
	want := map[string]string{"x_total": "otel_scope_name pool reason", "up": "", "d_bucket": "le"}
	for m, ls := range want {
		if got := strings.Join(sortedKeys(e[m]), " "); e[m] == nil || got != ls {
			t.Errorf("labels of %s: %q (present %v); want %q", m, got, e[m] != nil, ls)
		}
	}
	if len(e) != len(want) {
		t.Errorf("metrics %v; want %v", sortedKeys(map[string]bool{}), want)
	}
}

// missingRefs checks every query against e and returns one line per name
// or label no service emits. The series a recording rule writes count as
// emitted, with the labels of the metrics it reads.
func missingRefs(t *testing.T, queries []query, e exposition) []string {
	t.Helper()
	emitted := exposition{}
	for m, ls := range e {
		emitted[m] = ls
	}
	for _, q := range queries {
		if q.record == "" {
			continue
		}
		ref, err := parsePromQL(q.expr)
		if err != nil {
			t.Fatalf("%s: %v", q.where, err)
		}
		ls := map[string]bool{}
		for _, m := range ref.Metrics {
			for l := range e[m] {
				ls[l] = true
			}
		}
		for _, l := range ref.Grouping {
			ls[l] = true
		}
		emitted[q.record] = ls
	}
	var missing []string
	for _, q := range queries {
		ref, err := parsePromQL(q.expr)
		if err != nil {
			t.Fatalf("%s: %v", q.where, err)
		}
		if len(ref.Metrics) == 0 {
			missing = append(missing, fmt.Sprintf("%s: no metric in %q", q.where, q.expr))
		}
		for _, m := range ref.Metrics {
			ls, ok := emitted[m]
			if !ok {
				missing = append(missing, fmt.Sprintf("%s: metric %s is not emitted", q.where, m))
				continue
			}
			for _, l := range ref.Matchers[m] {
				if !ls[l] && !scrapeLabels[l] {
					missing = append(missing, fmt.Sprintf("%s: %s has no label %s", q.where, m, l))
				}
			}
		}
		// A grouping label must be on some metric the query reads.
		for _, l := range ref.Grouping {
			found := scrapeLabels[l]
			for _, m := range ref.Metrics {
				found = found || emitted[m][l]
			}
			if !found {
				missing = append(missing, fmt.Sprintf("%s: no metric of the query has label %s (by/on/ignoring)", q.where, l))
			}
		}
	}
	sort.Strings(missing)
	return missing
}

func TestMissingRefs(t *testing.T) {
	e := exposition{"a_total": {"pool": true}, "b": {"le": true}}
	qs := []query{
		{where: "r1", record: "x:a:rate5m", expr: `sum by (pool) (rate(a_total[5m]))`},
		{where: "d1", expr: `x:a:rate5m{pool="p"} > 0`},
		{where: "d2", expr: `sum by (job, pool) (a_total{reason="z"})`},
		{where: "d3", expr: `sum by (state) (b)`},
		{where: "d4", expr: `c_total`},
	}
	got := strings.Join(missingRefs(t, qs, e), "\n")
	want := strings.Join([]string{
		"d2: a_total has no label reason",
		"d3: no metric of the query has label state (by/on/ignoring)",
		"d4: metric c_total is not emitted",
	}, "\n")
	if got != want {
		t.Errorf("missing:\n%s\nwant:\n%s", got, want)
	}
}

// TestDashboardDatasources checks that every datasource uid a dashboard
// names is provisioned by deploy/grafana/provisioning/datasources.
func TestDashboardDatasources(t *testing.T) {
	b, err := os.ReadFile(repoPath("deploy/grafana/provisioning/datasources/proxyfleet.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	provisioned := map[string]string{} // uid -> type
	var uid string
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "#") {
			continue
		}
		if v, ok := strings.CutPrefix(line, "uid:"); ok {
			uid = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "type:"); ok && uid != "" {
			provisioned[uid] = strings.TrimSpace(v)
			uid = ""
		}
	}
	if provisioned["proxyfleet-prometheus"] != "prometheus" {
		t.Fatalf("provisioned datasources %v; want proxyfleet-prometheus of type prometheus", provisioned)
	}
	files, _ := filepath.Glob(repoPath("deploy/grafana/dashboards/*.json"))
	for _, file := range files {
		raw, _ := os.ReadFile(file)
		for _, m := range regexp.MustCompile(`"datasource":\s*\{\s*"type":\s*"([^"]+)",\s*"uid":\s*"([^"]+)"`).FindAllStringSubmatch(string(raw), -1) {
			if provisioned[m[2]] != m[1] {
				t.Errorf("%s names datasource %s of type %s; provisioned: %v", filepath.Base(file), m[2], m[1], provisioned)
			}
		}
	}
}

// metricsServing finds a service's metrics address in its log.
var metricsServing = regexp.MustCompile(`"msg":"metrics endpoint serving"[^\n]*?"addr":"([^"]+)"`)

// metricsAddr waits until service name logged where it serves /metrics.
func (f *fleet) metricsAddr(name string) string {
	f.t.Helper()
	var addr string
	waitFor(f.t, 30*time.Second, name+"'s metrics endpoint", func() bool {
		m := metricsServing.FindStringSubmatch(f.log(name))
		if m == nil {
			return false
		}
		addr = m[1]
		return true
	})
	return addr
}

func scrape(addr string) (string, error) {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	return string(b), err
}

// TestDashboardsAndRulesMatchEmittedMetrics runs planner, health, the
// local agent and the gateway with metrics, applies a pool with a ban
// rule, sends a request through the gateway and has one proxy banned and
// replaced, then scrapes every service: each metric and label the
// dashboards and the rules use must be among what they emit.
func TestDashboardsAndRulesMatchEmittedMetrics(t *testing.T) {
	queries := append(dashboardQueries(t), ruleQueries(t)...)
	for _, q := range queries {
		if _, err := parsePromQL(q.expr); err != nil {
			t.Fatalf("%s: %v", q.where, err)
		}
	}

	site := limitedSite(t)
	f := newFleet(t)
	f.allow(site)
	f.dumpLogsOnFailure()
	metricsFlag := []string{"--metrics-addr", "127.0.0.1:0"}
	f.start("planner", append([]string{"--reconcile-interval", "200ms"}, metricsFlag...)...)
	f.start("health", append([]string{"--echo-addr", f.echoAddr, "--probe-interval", "300ms", "--probe-timeout", "2s"}, metricsFlag...)...)
	f.start("local-agent", append([]string{"--entry", "local", "--target", "t1", "--state-dir", f.stateDir,
		"--egress-allow", f.echoEndpoint(), "--ports", "0", "--capacity", "40"}, append(f.agentArg, metricsFlag...)...)...)
	f.waitAgent("local", "t1")
	f.waitLeader()
	gw := f.startGateway(metricsFlag...)
	addrs := map[string]string{}
	for _, name := range []string{"planner", "health", "local-agent", "gateway"} {
		addrs[name] = f.metricsAddr(name)
	}

	f.apply(events.PoolSpec{Name: "dash", Provider: "local", Size: 2,
		Gateway: &events.GatewaySpec{BanRules: []events.BanRule{{Name: "too-many", Status: []int{429}, Threshold: 3, Window: events.Duration(time.Minute)}}}})
	// An operator error, so the API's error codes are exported too.
	if _, err := retry(t, "pool.apply of an invalid name", func(ctx context.Context) (api.PoolView, error) {
		return f.api.PoolApply(ctx, events.PoolSpec{Name: "Not A Name", Provider: "local", Size: 1})
	}); err == nil {
		t.Fatal("pool.apply of an invalid name succeeded")
	}
	f.waitPool("dash", 2, "ready", 60*time.Second)
	c := gatewayClient(t, gw, "dash.session-one")
	var victim string
	waitFor(t, 30*time.Second, "a request through the gateway", func() bool {
		code, _, via, err := viaGateway(c, site.URL+"/")
		victim = via
		return err == nil && code == 200 && via != ""
	})
	for range 3 {
		if _, _, _, err := viaGateway(c, site.URL+"/limited"); err != nil {
			t.Fatalf("request to /limited: %v", err)
		}
	}
	waitFor(t, 60*time.Second, "the banned proxy replaced by a ready one", func() bool {
		n := 0
		for _, p := range f.proxies("dash") {
			if p.ID == victim {
				return false
			}
			if p.State == "ready" {
				n++
			}
		}
		return n == 2
	})

	// Gauges and the consumers' figures are observed periodically: scrape
	// until nothing is missing, or report what still is after 20 s.
	var missing []string
	var e exposition
	deadline := time.Now().Add(20 * time.Second)
	for {
		e = exposition{}
		for _, name := range []string{"planner", "health", "local-agent", "gateway"} {
			body, err := scrape(addrs[name])
			if err != nil {
				t.Fatalf("scrape %s at %s: %v", name, addrs[name], err)
			}
			e.add(body)
		}
		missing = missingRefs(t, queries, e)
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if len(missing) > 0 {
		var names []string
		for m := range e {
			if strings.HasPrefix(m, "proxyfleet") {
				names = append(names, m)
			}
		}
		sort.Strings(names)
		t.Errorf("%d references of deploy/grafana and deploy/prometheus to what no service emits:\n  %s\nproxyfleet metrics emitted: %s",
			len(missing), strings.Join(missing, "\n  "), strings.Join(names, " "))
	}
}
