package planner

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/planner/internal/decide"
)

// condition returns the pool's condition of type typ as pool.get answers.
func (h *harness) condition(pool, typ string) (events.Condition, bool) {
	h.t.Helper()
	var v api.PoolView
	h.ok(poolGet, `{"name":"`+pool+`"}`, &v)
	return events.FindCondition(v.Conditions, typ)
}

// waitCondition waits until pool.get shows the condition with status and
// reason, and returns it.
func (h *harness) waitCondition(pool, typ, status, reason string, within time.Duration) events.Condition {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for {
		c, ok := h.condition(pool, typ)
		if ok && c.Status == status && c.Reason == reason {
			return c
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("pool %s: condition %s is %+v, want %s with reason %s within %s", pool, typ, c, status, reason, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// conditionEvents counts the condition events of pool.
func (h *harness) conditionEvents(pool string) int {
	n := 0
	for _, e := range h.eventsOf(events.AggregatePool, events.PoolCondition) {
		if e.ID == pool {
			n++
		}
	}
	return n
}

// TestPlacedConditionSaysWhy: a pool asking for an image no target offers
// says so in pool.get within 5 s, naming the targets considered; a re-apply
// without the image turns Placed True and the pool fills.
func TestPlacedConditionSaysWhy(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Images: []string{"debian-12"}})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.startPlannerWith(Config{ID: "cond", ReconcileInterval: 2 * time.Second}, nil)
	h.waitFor("leader", r.IsLeader)
	d := &driver{h: h, done: map[string]bool{}}

	h.ok(poolApply, `{"name":"img","provider":"local","size":2,"image":"none-offers-this"}`, nil)
	c := h.waitCondition("img", events.ConditionPlaced, events.ConditionFalse, events.ReasonNoTargetOffersImage, 5*time.Second)
	for _, want := range []string{"none-offers-this", "t1 (offers debian-12)", "t2 (offers nothing)"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("Placed message %q does not name %q", c.Message, want)
		}
	}
	if rc, _ := h.condition("img", events.ConditionReady); rc.Status != events.ConditionFalse || rc.Reason != events.ReasonNotEnoughReady {
		t.Errorf("Ready: got %+v, want False NotEnoughReady", rc)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 0 {
		t.Fatalf("requested: got %d, want 0", n)
	}
	// Transitions only: rounds that find the same reason append nothing.
	n := h.conditionEvents("img")
	h.settle(r, 3)
	if got := h.conditionEvents("img"); got != n {
		t.Errorf("condition events while nothing changed: got %d, want %d", got, n)
	}

	h.ok(poolApply, `{"name":"img","provider":"local","size":2}`, nil)
	placed := h.waitCondition("img", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 10*time.Second)
	if !placed.Since.After(c.Since) {
		t.Errorf("Placed since: got %s, want after %s (the status changed)", placed.Since, c.Since)
	}
	h.waitFor("pool ready", func() bool {
		d.step()
		rc, _ := h.condition("img", events.ConditionReady)
		return rc.Status == events.ConditionTrue
	})
	h.waitCondition("img", events.ConditionProgressing, events.ConditionFalse, events.ReasonSettled, 10*time.Second)
}

// TestPlacedConditionReasons: no live target, a full target and a target
// in quota backoff each give their own reason.
func TestPlacedConditionReasons(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Capacity: 1})
	h.agent(agent.Info{Entry: "other", Target: "o1"})
	r := h.startPlannerWith(Config{ID: "why"}, nil)
	h.waitFor("leader", r.IsLeader)

	// Capacity: one slot on the only target.
	h.ok(poolApply, `{"name":"full","provider":"local","size":2}`, nil)
	c := h.waitCondition("full", events.ConditionPlaced, events.ConditionFalse, events.ReasonCapacityExhausted, 10*time.Second)
	if !strings.Contains(c.Message, "t1 (1 of 1)") {
		t.Errorf("CapacityExhausted message %q does not name t1 (1 of 1)", c.Message)
	}

	// Quota: the target answered quota a moment ago.
	h.ok(poolApply, `{"name":"q","provider":"other","size":2}`, nil)
	var first string
	h.waitFor("a proxy of q", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
			if strings.HasPrefix(e.ID, "q-") {
				first = e.ID
			}
		}
		return first != ""
	})
	h.observe(first, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassQuota, Reason: "QUOTA_EXCEEDED", Attempt: 1})
	c = h.waitCondition("q", events.ConditionPlaced, events.ConditionFalse, events.ReasonQuota, 10*time.Second)
	if !strings.Contains(c.Message, "o1 (quota at") {
		t.Errorf("Quota message %q does not name o1", c.Message)
	}

	// No live target: the only agent of the entry went away.
	h.goneAgent("local", "t1")
	h.ok(poolApply, `{"name":"full","provider":"local","size":3}`, nil)
	c = h.waitCondition("full", events.ConditionPlaced, events.ConditionFalse, events.ReasonNoLiveTarget, 10*time.Second)
	if !strings.Contains(c.Message, "t1") {
		t.Errorf("NoLiveTarget message %q does not name t1", c.Message)
	}
}

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

// recorded is the spans a test's tracer provider ended.
type recorded struct {
	h  *harness
	sr *tracetest.SpanRecorder
}

// waitSpan waits until a span named name for which match holds has
// ended, and returns it.
func (r recorded) waitSpan(name string, match func(sdktrace.ReadOnlySpan) bool) sdktrace.ReadOnlySpan {
	r.h.t.Helper()
	var found sdktrace.ReadOnlySpan
	r.h.waitFor("span "+name, func() bool {
		for _, s := range r.sr.Ended() {
			if s.Name() == name && (match == nil || match(s)) {
				found = s
				return true
			}
		}
		return false
	})
	return found
}

// inTrace lists the ended spans of trace id.
func (r recorded) inTrace(id trace.TraceID) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range r.sr.Ended() {
		if s.SpanContext().TraceID() == id {
			out = append(out, s)
		}
	}
	return out
}

func attrOf(s sdktrace.ReadOnlySpan, key string) string {
	for _, a := range s.Attributes() {
		if string(a.Key) == key {
			return a.Value.String()
		}
	}
	return ""
}

func hasAttr(key, value string) func(sdktrace.ReadOnlySpan) bool {
	return func(s sdktrace.ReadOnlySpan) bool { return attrOf(s, key) == value }
}

func names(spans []sdktrace.ReadOnlySpan) []string {
	out := make([]string, len(spans))
	for i, s := range spans {
		out[i] = s.Name()
	}
	return out
}

// TestTracesOfRequestsAndLaterWork: every operator request is a trace of
// its own. The creates of a pool.apply's fill belong to the apply's trace;
// the replacement of a proxy that fails later starts new traces linking
// to the apply; a recycle's replacement is in the recycle's trace, and the
// recycled proxy's retirement, once the replacement is ready, is a new
// root linking to it; a pool.delete is one trace holding the retirement of the
// pool's proxy and its delete command, none of it in the apply's trace. A
// refused request (400) does not mark its span failed; publish spans
// carry the messaging attributes.
func TestTracesOfRequestsAndLaterWork(t *testing.T) {
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newHarness(t)
	rec := recorded{h: h, sr: sr}
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlanner("traced", tp.Tracer("planner-test"))
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	applySpan := rec.waitSpan("planner.api.pool.apply", nil)
	apply := applySpan.SpanContext().TraceID()
	if applySpan.Parent().IsValid() {
		t.Errorf("apply without a traceparent: span has parent %s, want a root", applySpan.Parent().SpanID())
	}
	if got := attrOf(applySpan, "messaging.operation.type"); got != "process" {
		t.Errorf("API span messaging.operation.type: got %q, want process", got)
	}
	ids, _ := h.requested(1)
	first := ids[0]
	create := rec.waitSpan("planner.create", hasAttr("proxy", first))
	if create.SpanContext().TraceID() != apply {
		t.Errorf("the fill's create: trace %s, want the apply's %s", create.SpanContext().TraceID(), apply)
	}
	pub := rec.waitSpan("publish fleet.cmd.{entry}.{target}.create", hasAttr("proxy", first))
	for k, want := range map[string]string{
		"messaging.system":           "nats",
		"messaging.destination.name": "fleet.cmd.local.t1.create",
		"messaging.operation.type":   "publish",
	} {
		if got := attrOf(pub, k); got != want {
			t.Errorf("create publish span %s: got %q, want %q", k, got, want)
		}
	}
	if pub.SpanKind() != trace.SpanKindProducer || pub.SpanContext().TraceID() != apply || pub.Parent().SpanID() != create.SpanContext().SpanID() {
		t.Errorf("create publish span: kind %v, trace %s, parent %s; want a producer child of planner.create in the apply's trace",
			pub.SpanKind(), pub.SpanContext().TraceID(), pub.Parent().SpanID())
	}
	var creates []command
	h.waitFor("create command", func() bool { creates = h.commandsOf(events.VerbCreate); return len(creates) == 1 })
	if got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), creates[0].Header)); got.SpanID() != pub.SpanContext().SpanID() {
		t.Errorf("create command carries span %s, want its publish span %s", got.SpanID(), pub.SpanContext().SpanID())
	}

	// Later, the proxy fails: its retirement and its replacement are
	// traces of their own, linked to the apply.
	h.observe(first, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "broken", Attempt: 1})
	ids, _ = h.requested(2)
	second := ids[1]
	for _, s := range []sdktrace.ReadOnlySpan{
		rec.waitSpan("planner.retire", hasAttr("proxy", first)),
		rec.waitSpan("planner.create", hasAttr("proxy", second)),
	} {
		if s.Parent().IsValid() || s.SpanContext().TraceID() == apply {
			t.Errorf("%s %s: parent %s, trace %s; want a new root outside the apply's trace %s",
				s.Name(), attrOf(s, "proxy"), s.Parent().SpanID(), s.SpanContext().TraceID(), apply)
		}
		if links := s.Links(); len(links) != 1 || links[0].SpanContext.TraceID() != apply {
			t.Errorf("%s %s: links %+v, want one to the apply's trace %s", s.Name(), attrOf(s, "proxy"), links, apply)
		}
	}

	// A recycle is a trace of its own holding the replacement's create;
	// the retirement of the recycled proxy once its replacement is ready
	// is a new root linking to it.
	recycleCtx, recycleOp := tp.Tracer("operator").Start(context.Background(), "operator.recycle")
	hdr := nats.Header{}
	telemetry.Inject(recycleCtx, hdr)
	recycleOp.End()
	recycle := recycleOp.SpanContext().TraceID()
	if res := h.request(proxyRecycle, `{"id":"`+second+`"}`, hdr); res.Code != "" {
		t.Fatalf("proxy.recycle: %+v", res.Error)
	}
	ids, _ = h.requested(3)
	third := ids[2]
	if s := rec.waitSpan("planner.create", hasAttr("proxy", third)); s.SpanContext().TraceID() != recycle {
		t.Errorf("the recycle's replacement: trace %s, want the recycle's %s", s.SpanContext().TraceID(), recycle)
	}
	h.observe(third, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(third), Attempt: 1})
	h.observe(third, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
	h.observe(third, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})
	recycled := rec.waitSpan("planner.retire", hasAttr("proxy", second))
	if recycled.Parent().IsValid() || recycled.SpanContext().TraceID() == recycle {
		t.Errorf("retirement of the recycled proxy: parent %s, trace %s; want a new root", recycled.Parent().SpanID(), recycled.SpanContext().TraceID())
	}
	if links := recycled.Links(); len(links) != 1 || links[0].SpanContext.TraceID() != recycle {
		t.Errorf("retirement of the recycled proxy: links %+v, want one to the recycle's trace %s", links, recycle)
	}

	// A refused request is not a failed span.
	if res := h.request(poolApply, `{"name":`, nil); res.Code != "400" {
		t.Fatalf("bad request: got code %q, want 400", res.Code)
	}
	refused := rec.waitSpan("planner.api.pool.apply", hasAttr("proxyfleet.api.code", "400"))
	if st := refused.Status(); st.Code != codes.Unset {
		t.Errorf("400 reply: span status %v %q, want Unset", st.Code, st.Description)
	}

	// The pool.delete is one trace: the request, the retirement of the
	// pool's live proxy and its delete command.
	ctx, op := tp.Tracer("operator").Start(context.Background(), "operator.delete")
	hdr = nats.Header{}
	telemetry.Inject(ctx, hdr)
	op.End()
	if res := h.request(poolDelete, `{"name":"demo"}`, hdr); res.Code != "" {
		t.Fatalf("pool.delete: %+v", res.Error)
	}
	del := op.SpanContext().TraceID()
	deleteSpan := rec.waitSpan("planner.api.pool.delete", nil)
	if deleteSpan.SpanContext().TraceID() != del || deleteSpan.Parent().SpanID() != op.SpanContext().SpanID() {
		t.Errorf("pool.delete span: trace %s, parent %s; want the caller's trace %s, parent %s",
			deleteSpan.SpanContext().TraceID(), deleteSpan.Parent().SpanID(), del, op.SpanContext().SpanID())
	}
	retire := rec.waitSpan("planner.retire", hasAttr("proxy", third))
	cmd := rec.waitSpan("publish fleet.cmd.{entry}.{target}.delete", hasAttr("proxy", third))
	for _, s := range []sdktrace.ReadOnlySpan{retire, cmd} {
		if s.SpanContext().TraceID() != del {
			t.Errorf("%s %s: trace %s, want the pool.delete's %s", s.Name(), attrOf(s, "proxy"), s.SpanContext().TraceID(), del)
		}
	}
	if attrOf(retire, "reason") != "pool deleted" {
		t.Errorf("retire span reason: got %q, want pool deleted", attrOf(retire, "reason"))
	}
	var deletes []command
	h.waitFor("delete command of the pool's proxy", func() bool {
		deletes = nil
		for _, c := range h.commandsOf(events.VerbDelete) {
			if c.Delete.ProxyID == third {
				deletes = append(deletes, c)
			}
		}
		return len(deletes) == 1
	})
	if got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), deletes[0].Header)).TraceID(); got != del {
		t.Errorf("delete command trace: got %s, want the pool.delete's %s", got, del)
	}
	want := map[string]bool{"planner.api.pool.delete": false, "publish fleet.evt.pool.{id}.deleted": false,
		"planner.retire": false, "publish fleet.evt.proxy.{id}.retiring": false, "publish fleet.cmd.{entry}.{target}.delete": false}
	for _, s := range rec.inTrace(del) {
		if _, ok := want[s.Name()]; ok {
			want[s.Name()] = true
		}
	}
	for name, seen := range want {
		if !seen {
			t.Errorf("pool.delete trace lacks %s; it has %v", name, names(rec.inTrace(del)))
		}
	}
	for _, s := range rec.inTrace(apply) {
		if s.Name() == "planner.retire" || s.Name() == "publish fleet.cmd.{entry}.{target}.delete" {
			t.Errorf("the apply's trace holds %s %s: later work appended to it", s.Name(), attrOf(s, "proxy"))
		}
	}
}

func TestTraceFromRequestReachesCommands(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlanner("traced", tp.Tracer("planner-test"))
	h.waitFor("leader", r.IsLeader)

	ctx, span := tp.Tracer("operator").Start(context.Background(), "operator.apply")
	hdr := nats.Header{}
	telemetry.Inject(ctx, hdr)
	span.End()
	want := span.SpanContext().TraceID()
	if res := h.request(poolApply, `{"name":"demo","provider":"local","size":1}`, hdr); res.Code != "" {
		t.Fatalf("apply: %+v", res.Error)
	}
	var creates []command
	h.waitFor("create", func() bool { creates = h.commandsOf(events.VerbCreate); return len(creates) == 1 })
	got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), creates[0].Header)).TraceID()
	if got != want {
		t.Errorf("create command trace id: got %s, want %s", got, want)
	}
	applied := h.eventsOf(events.AggregatePool, events.PoolApplied)
	if got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), applied[0].Header)).TraceID(); got != want {
		t.Errorf("applied event trace id: got %s, want %s", got, want)
	}
	// The reconciler's decision continues it too, whatever batch carried
	// it.
	requested := h.eventsOf(events.AggregateProxy, events.ProxyRequested)
	if got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), requested[0].Header)).TraceID(); got != want {
		t.Errorf("requested event trace id: got %s, want %s", got, want)
	}
}

// TestNewLeaderContinuesRequestsMadeSinceItsTerm: a new leader decides
// only once its projection holds its term's event, and a request can land
// in between (its replica served it as soon as the lease was won). Its
// first round continues the trace of such a request; a pool's request
// before the term event, which an earlier leader may have handled, gets a
// trace of its own linking to it.
func TestNewLeaderContinuesRequestsMadeSinceItsTerm(t *testing.T) {
	const (
		earlier = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		since   = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	)
	st := newState(testLogger(), 0)
	old, fresh := st.pool("old"), st.pool("fresh")
	old.traceparent, old.traceSeq = earlier, 5
	fresh.traceparent, fresh.traceSeq = since, 12
	rc := &reconciler{Planner: &Planner{st: st}}
	rc.noteTraced(10)

	traceOf := func(tp string) trace.TraceID {
		return trace.SpanContextFromContext(traceCtx(context.Background(), tp)).TraceID()
	}
	ctx := rc.poolCtx(context.Background(), *fresh)
	if got := trace.SpanContextFromContext(ctx).TraceID(); got != traceOf(since) {
		t.Errorf("first round for a request made since the term began: trace %s, want the request's %s", got, traceOf(since))
	}
	if ctx.Value(causeKey{}) != nil {
		t.Error("first round for a request made since the term began: links to it instead of continuing it")
	}
	ctx = rc.poolCtx(context.Background(), *old)
	if trace.SpanContextFromContext(ctx).IsValid() {
		t.Errorf("round for a request before the term: continues trace %s, want a trace of its own", trace.SpanContextFromContext(ctx).TraceID())
	}
	if sc, ok := ctx.Value(causeKey{}).(trace.SpanContext); !ok || sc.TraceID() != traceOf(earlier) {
		t.Errorf("round for a request before the term: links to %v, want the request's trace %s", ctx.Value(causeKey{}), traceOf(earlier))
	}
	// The request made since the term is continued once: the next
	// round links to it.
	if ctx := rc.poolCtx(context.Background(), *fresh); ctx.Value(causeKey{}) == nil {
		t.Error("second round for the same request: continues it again, want a link")
	}
}

// failedEvents counts the failed events of proxy id.
func (h *harness) failedEvents(id string) int {
	n := 0
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
		if e.ID == id {
			n++
		}
	}
	return n
}

// healthUnavailableEvents counts the condition events of pool saying
// health is unavailable.
func (h *harness) healthUnavailableEvents(pool string) int {
	n := 0
	for _, e := range h.eventsOf(events.AggregatePool, events.PoolCondition) {
		var d events.PoolConditionData
		if e.ID == pool && e.DecodeData(&d) == nil && d.Reason == events.ReasonHealthUnavailable {
			n++
		}
	}
	return n
}

// TestHealthUnavailableSuspendsReadyTimeout: while no health replica is
// alive, every pool's Ready condition is Unknown with reason
// HealthUnavailable, and a proxy running past the ready timeout is not
// failed (nobody could probe it); once health is back the condition
// returns and the proxy gets a fresh ready timeout from then, rather than
// failing at once. A planner that starts while health is alive never
// reports it unavailable.
func TestHealthUnavailableSuspendsReadyTimeout(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	const readyTimeout = 1500 * time.Millisecond
	r := h.startPlannerWith(Config{ID: "blind", ReadyTimeout: readyTimeout}, nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"blind","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]
	h.waitCondition("blind", events.ConditionReady, events.ConditionFalse, events.ReasonNotEnoughReady, 5*time.Second)
	h.settle(r, 3)
	if n := h.healthUnavailableEvents("blind"); n != 0 {
		t.Fatalf("health unavailable reported %d times while a health replica was alive", n)
	}

	h.healthDown(false)
	c := h.waitCondition("blind", events.ConditionReady, events.ConditionUnknown, events.ReasonHealthUnavailable, 10*time.Second)
	if !strings.Contains(c.Message, "no health replica is alive since ") || !strings.Contains(c.Message, "readiness unknown") {
		t.Errorf("Ready message: got %q, want it to say since when no health replica is alive and that readiness is unknown", c.Message)
	}
	h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1})
	h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
	// Twice the ready timeout without health: nothing fails.
	time.Sleep(2 * readyTimeout)
	h.settle(r, 3)
	if n := h.failedEvents(id); n != 0 {
		t.Fatalf("a running proxy failed %d times while no health replica was alive to probe it", n)
	}

	h.healthUp()
	back := time.Now()
	h.waitCondition("blind", events.ConditionReady, events.ConditionFalse, events.ReasonNotEnoughReady, 10*time.Second)
	var failed events.ProxyFailedData
	h.waitFor("the proxy to fail once the fresh ready timeout ran out", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
			if e.ID == id && e.DecodeData(&failed) == nil {
				return true
			}
		}
		return false
	})
	if since := time.Since(back); since < readyTimeout {
		t.Errorf("the proxy failed %s after health came back, before the ready timeout of %s", since, readyTimeout)
	}
	if failed.Class != events.ClassTimeout || !strings.HasPrefix(failed.Reason, decide.NotReadyPrefix) {
		t.Errorf("failed: got %+v, want class timeout, a not-ready reason", failed)
	}
}

// TestHealthExpiredIsUnavailable: a health replica that dies leaves its
// key to expire (no marker to watch); the planner still notices.
func TestHealthExpiredIsUnavailable(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	h.ok(poolApply, `{"name":"dead","provider":"local","size":1}`, nil)
	h.requested(1)
	h.waitCondition("dead", events.ConditionReady, events.ConditionFalse, events.ReasonNotEnoughReady, 5*time.Second)
	h.healthDown(true)
	h.waitCondition("dead", events.ConditionReady, events.ConditionUnknown, events.ReasonHealthUnavailable, 15*time.Second)
}

// putCheck writes a target's check record into fleet-targets as health's
// target checker does, taken at at.
func (h *harness) putCheck(target string, at time.Time, failing ...agent.Verdict) {
	h.t.Helper()
	kv, err := h.c.JS.KeyValue(context.Background(), bus.BucketTargets)
	if err != nil {
		h.t.Fatal(err)
	}
	rec := agent.TargetCheck{Entry: "local", Target: target, OK: len(failing) == 0, At: at.UTC(),
		Verdicts: append([]agent.Verdict{{Check: "version", OK: true}}, failing...)}
	b, _ := json.Marshal(rec)
	if _, err := kv.Put(context.Background(), agent.HeartbeatKey("local", target), b); err != nil {
		h.t.Fatal(err)
	}
}

// TestPlacementSkipsTargetsFailingChecks: a target whose latest check in
// fleet-targets fails takes no new proxy; when every target fails, the
// pool's Placed condition says TargetsUnhealthy, naming the targets and
// their failing checks; a target that passes again fills the pool, and a
// failed record too old to trust (health down) blocks nothing.
func TestPlacementSkipsTargetsFailingChecks(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	notRunning := agent.Verdict{Check: "pool", OK: false, Detail: "not running"}
	h.putCheck("t1", time.Now(), notRunning)
	h.putCheck("t2", time.Now())
	r := h.startPlannerWith(Config{ID: "checks", CheckMaxAge: time.Minute}, nil)
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"spread","provider":"local","size":2}`, nil)
	_, req := h.requested(2)
	for id, d := range req {
		if d.Target != "t2" {
			t.Errorf("proxy %s placed on %s, whose check fails; want t2", id, d.Target)
		}
	}

	h.putCheck("t2", time.Now(), agent.Verdict{Check: "disk", OK: false, Detail: "1% free"})
	h.ok(poolApply, `{"name":"stuck","provider":"local","size":1}`, nil)
	c := h.waitCondition("stuck", events.ConditionPlaced, events.ConditionFalse, events.ReasonTargetsUnhealthy, 10*time.Second)
	for _, want := range []string{"t1 (pool: not running)", "t2 (disk: 1% free)"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("Placed message %q does not name %q", c.Message, want)
		}
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 2 {
		t.Fatalf("requested: got %d, want the 2 of pool spread alone", n)
	}

	h.putCheck("t1", time.Now())
	h.waitCondition("stuck", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 10*time.Second)
	_, req = h.requested(3)
	for id, d := range req {
		if d.Pool == "stuck" && d.Target != "t1" {
			t.Errorf("proxy %s placed on %s, whose check fails; want t1", id, d.Target)
		}
	}

	// Records older than CheckMaxAge: health stopped checking; they no
	// longer keep proxies off.
	h.putCheck("t1", time.Now().Add(-2*time.Minute), notRunning)
	h.putCheck("t2", time.Now().Add(-2*time.Minute), notRunning)
	h.ok(poolApply, `{"name":"stale","provider":"local","size":1}`, nil)
	h.requested(4)
}
