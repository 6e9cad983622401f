package planner

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

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
