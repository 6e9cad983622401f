package telemetry_test

import (
	"context"
	"maps"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/telemetry"
)

func TestMessagingAttrs(t *testing.T) {
	for _, tc := range []struct {
		op, subject, template string
		want                  map[string]string
	}{
		{telemetry.OpPublish, "fleet.cmd.local.t1.create", "fleet.cmd.{entry}.{target}.create", map[string]string{
			"messaging.system": "nats", "messaging.destination.name": "fleet.cmd.local.t1.create",
			"messaging.operation.type": "publish", "messaging.operation.name": "publish",
			"messaging.destination.template": "fleet.cmd.{entry}.{target}.create",
		}},
		{telemetry.OpSend, "fleet.evt.proxy.demo-a.ready", "", map[string]string{
			"messaging.system": "nats", "messaging.destination.name": "fleet.evt.proxy.demo-a.ready",
			"messaging.operation.type": "send", "messaging.operation.name": "send",
		}},
		{telemetry.OpProcess, "fleet.api.pool.apply", "", map[string]string{
			"messaging.system": "nats", "messaging.destination.name": "fleet.api.pool.apply",
			"messaging.operation.type": "process", "messaging.operation.name": "process",
		}},
	} {
		got := map[string]string{}
		for _, kv := range telemetry.MessagingAttrs(tc.op, tc.subject, tc.template) {
			got[string(kv.Key)] = kv.Value.AsString()
		}
		if !maps.Equal(got, tc.want) {
			t.Errorf("MessagingAttrs(%q, %q, %q) = %v, want %v", tc.op, tc.subject, tc.template, got, tc.want)
		}
	}
}

func TestNewRootLinkedTo(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := tp.Tracer("test")
	reqCtx, request := tr.Start(context.Background(), "request")
	request.End()
	// The work runs under some other span: it must not become its child.
	busyCtx, busy := tr.Start(context.Background(), "round")
	defer busy.End()

	for _, tc := range []struct {
		name  string
		cause trace.SpanContext
		why   string
		links int
	}{
		{"caused", request.SpanContext(), telemetry.LinkCausedBy, 1},
		{"requested", trace.SpanContextFromContext(reqCtx), telemetry.LinkRequested, 1},
		{"no cause", trace.SpanContext{}, telemetry.LinkCausedBy, 0},
	} {
		_, s := tr.Start(busyCtx, tc.name, telemetry.NewRootLinkedTo(tc.cause, tc.why)...)
		s.End()
		got := rec.Ended()[len(rec.Ended())-1]
		if got.Parent().IsValid() {
			t.Errorf("%s: parent %v, want a root", tc.name, got.Parent())
		}
		if tid := got.SpanContext().TraceID(); tid == request.SpanContext().TraceID() || tid == busy.SpanContext().TraceID() {
			t.Errorf("%s: trace %s is the request's or the round's; want one of its own", tc.name, tid)
		}
		links := got.Links()
		if len(links) != tc.links {
			t.Fatalf("%s: links %v, want %d", tc.name, links, tc.links)
		}
		if tc.links == 0 {
			continue
		}
		if links[0].SpanContext.SpanID() != request.SpanContext().SpanID() || links[0].SpanContext.TraceID() != request.SpanContext().TraceID() {
			t.Errorf("%s: link to %v, want the request's span %v", tc.name, links[0].SpanContext, request.SpanContext())
		}
		if len(links[0].Attributes) != 1 || links[0].Attributes[0].Key != telemetry.AttrLink || links[0].Attributes[0].Value.AsString() != tc.why {
			t.Errorf("%s: link attributes %v, want proxyfleet.link=%s", tc.name, links[0].Attributes, tc.why)
		}
	}
}
