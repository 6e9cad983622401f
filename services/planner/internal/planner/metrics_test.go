package planner

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// TestMetricsDescribeTheFleet scrapes a planner's Prometheus endpoint, as
// telemetry.Setup serves it, and finds the names and labels
// docs/observability.md promises: a pool of 3 made ready is desired 3 and
// ready 3, API requests are counted by endpoint and code (a refused one
// too), a dead-lettered command and the replacement of its failed proxy
// are counted.
func TestMetricsDescribeTheFleet(t *testing.T) {
	ctx := context.Background()
	tel, err := telemetry.Setup(ctx, telemetry.Config{Service: "planner-test", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Close(context.Background()) })
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlannerMeasured(Config{ID: "measured"}, nil, tel.Meter)
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"demo","provider":"local","size":3}`, nil)
	if res := h.request(poolApply, `{"name":`, nil); res.Code != "400" {
		t.Fatalf("bad request: got code %q, want 400", res.Code)
	}
	ids, _ := h.requested(3)
	for _, id := range ids {
		h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1})
		h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})
	}

	m := h.scrapeUntil(tel.MetricsAddr, "pool demo ready", func(m scraped) bool {
		return m.is(`proxyfleet_pool_ready_proxies{pool="demo"}`, 3)
	})
	for _, want := range []struct {
		series string
		value  float64
	}{
		{`proxyfleet_pool_desired_proxies{pool="demo"}`, 3},
		{`proxyfleet_pool_ready_proxies{pool="demo"}`, 3},
		{`proxyfleet_pool_proxies{pool="demo",state="ready"}`, 3},
		{`proxyfleet_planner_leader`, 1},
		{`proxyfleet_api_requests_total{code="ok",endpoint="pool.apply"}`, 1},
		{`proxyfleet_api_requests_total{code="400",endpoint="pool.apply"}`, 1},
		{`proxyfleet_api_request_duration_seconds_count{endpoint="pool.apply"}`, 2},
		{`proxyfleet_planner_decisions_total{type="applied"}`, 1},
		{`proxyfleet_planner_decisions_total{type="requested"}`, 3},
		{`proxyfleet_planner_commands_total{verb="create"}`, 3},
	} {
		if got, ok := m[want.series]; !ok || got != want.value {
			t.Errorf("%s: got %v (present %t), want %v\n%s", want.series, got, ok, want.value, m.named("proxyfleet_"))
		}
	}
	if n := m[`proxyfleet_planner_reconcile_duration_seconds_count`]; n < 1 {
		t.Errorf("proxyfleet_planner_reconcile_duration_seconds_count: got %v, want at least 1", n)
	}
	if _, ok := m[`proxyfleet_planner_reconcile_duration_seconds_bucket{le="0.001"}`]; !ok {
		t.Errorf("reconcile duration has no 1ms bucket:\n%s", m.named("proxyfleet_planner_reconcile"))
	}
	if age, ok := m[`proxyfleet_agent_heartbeat_age_seconds{entry="local",target="t1"}`]; !ok || age < 0 || age > 60 {
		t.Errorf("heartbeat age of local/t1: got %v (present %t), want between 0 and 60", age, ok)
	}

	// An agent dead-letters a command: the proxy fails, is retired and
	// replaced by the fill.
	h.observe(ids[0], events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassDeadLetter, Reason: "command never acknowledged", Attempt: 1})
	h.requested(4)
	m = h.scrapeUntil(tel.MetricsAddr, "the replacement counted", func(m scraped) bool {
		return m.is(`proxyfleet_planner_replacements_total{pool="demo",reason="failed"}`, 1)
	})
	for _, want := range []struct {
		series string
		value  float64
	}{
		{`proxyfleet_planner_dead_letters_total{entry="local",target="t1"}`, 1},
		{`proxyfleet_planner_decisions_total{type="retiring"}`, 1},
		{`proxyfleet_pool_ready_proxies{pool="demo"}`, 2},
	} {
		if got, ok := m[want.series]; !ok || got != want.value {
			t.Errorf("%s: got %v (present %t), want %v\n%s", want.series, got, ok, want.value, m.named("proxyfleet_"))
		}
	}
}

func TestReasonClass(t *testing.T) {
	for _, c := range []struct{ reason, want string }{
		{"unhealthy: probe failed: connect refused", "unhealthy"},
		{"unhealthy", "unhealthy"},
		{"banned: too-many", "banned"},
		{"recycled by operator", "recycled"},
		{"rotated: older than maxAge 1h0m0s", "rotated"},
		{"rolled: spec revision 3", "rolled"},
		{"failed: quota", "failed"},
		{"never-ready", "never-ready"},
		{"something else entirely", "other"},
		{"", "other"},
	} {
		if got := reasonClass(c.reason); got != c.want {
			t.Errorf("reasonClass(%q) = %q, want %q", c.reason, got, c.want)
		}
	}
}

// scraped is one scrape of a Prometheus endpoint: the value of each series
// by `name{label="value",...}`, labels sorted by name, without the OTel
// scope labels.
type scraped map[string]float64

// is reports whether series is present with value v.
func (m scraped) is(series string, v float64) bool {
	got, ok := m[series]
	return ok && got == v
}

// named lists the series whose name starts with prefix, for failure
// messages.
func (m scraped) named(prefix string) string {
	var b strings.Builder
	for k, v := range m {
		if strings.HasPrefix(k, prefix) {
			fmt.Fprintf(&b, "  %s %v\n", k, v)
		}
	}
	return b.String()
}

// scrapeUntil scrapes addr until cond holds on a scrape, and returns it.
func (h *harness) scrapeUntil(addr, what string, cond func(scraped) bool) scraped {
	h.t.Helper()
	var last scraped
	var err error
	h.waitFor(what+" in the scraped metrics", func() bool {
		last, err = scrape(addr)
		return err == nil && cond(last)
	})
	return last
}

// scrape reads the text exposition at http://addr/metrics.
func scrape(addr string) (scraped, error) {
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	out := scraped{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			return nil, fmt.Errorf("unreadable line %q", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("line %q: %w", line, err)
		}
		out[seriesKey(line[:i])] = v
	}
	return out, sc.Err()
}

// seriesKey normalises `name{a="1",b="2"}`: labels sorted, the OTel scope
// labels dropped. Label values here hold no commas or escaped quotes.
func seriesKey(s string) string {
	name, rest, ok := strings.Cut(s, "{")
	if !ok {
		return s
	}
	var labels []string
	for _, l := range strings.Split(strings.TrimSuffix(rest, "}"), ",") {
		if l == "" || strings.HasPrefix(l, "otel_scope_") {
			continue
		}
		labels = append(labels, l)
	}
	if len(labels) == 0 {
		return name
	}
	slices.Sort(labels)
	return name + "{" + strings.Join(labels, ",") + "}"
}
