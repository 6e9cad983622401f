package probe_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/health/internal/echo"
	"proxyfleet/services/health/internal/probe"
	"proxyfleet/services/health/internal/projection"
)

// TestTransitionIsANewTraceLinkedToTheRequest: a ready transition, which
// may come long after the operator request that asked for the proxy,
// starts a trace of its own with a link to the request's span instead of
// joining the request's trace; the log line of the transition carries the
// new trace's ids.
func TestTransitionIsANewTraceLinkedToTheRequest(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := bustest.Start(t)
	echoSrv := httptest.NewServer(echo.Handler())
	t.Cleanup(echoSrv.Close)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	logs := &testwait.Buffer{}
	log := telemetry.NewLogger(logs, slog.LevelInfo, "health")

	// The request: the planner appends requested inside its span.
	rctx, request := tp.Tracer("planner").Start(ctx, "planner.apply")
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	if _, err := bus.NewEventStore(c, events.SourcePlanner, nil).Append(rctx, events.AggregateProxy, "demo-a", events.ProxyRequested,
		"demo-a.requested.1", events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName("demo-a"), Revision: 1, Port: 3128}}, nil); err != nil {
		t.Fatal(err)
	}
	request.End()
	if _, err := bus.NewEventStore(c, events.AgentSource("local", "t1"), nil).Append(ctx, events.AggregateProxy, "demo-a", events.ProxyRunning,
		"demo-a.running.1", events.ProxyRunningData{Address: fp.addr, Attempt: 1}, nil); err != nil {
		t.Fatal(err)
	}

	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() { stop(); wg.Wait() })
	wg.Go(func() { _ = projection.New(c, nil, nil).Run(runCtx) })
	pr, err := probe.New(c, probe.Config{EchoURL: echoSrv.URL + "/", Interval: 50 * time.Millisecond, Timeout: 2 * time.Second, Concurrency: 2},
		log, &telemetry.Telemetry{Tracer: tp.Tracer("health"), Meter: metricnoop.NewMeterProvider().Meter("")})
	if err != nil {
		t.Fatal(err)
	}
	wg.Go(func() { _ = pr.Run(runCtx) })

	var transition sdktrace.ReadOnlySpan
	for transition == nil {
		for _, s := range rec.Ended() {
			if s.Name() == "health.transition" {
				transition = s
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no health.transition span; log:\n%s", logs)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if transition.Parent().IsValid() {
		t.Errorf("transition span has parent %v; want a root", transition.Parent())
	}
	if transition.SpanContext().TraceID() == request.SpanContext().TraceID() {
		t.Errorf("transition span is in the request's trace %s", request.SpanContext().TraceID())
	}
	links := transition.Links()
	if len(links) != 1 || links[0].SpanContext.SpanID() != request.SpanContext().SpanID() || links[0].SpanContext.TraceID() != request.SpanContext().TraceID() {
		t.Errorf("transition span links %v; want one to the request's span %v", links, request.SpanContext())
	}
	if transition.SpanKind() != trace.SpanKindProducer {
		t.Errorf("transition span kind %v; want producer", transition.SpanKind())
	}
	attrs := map[string]string{}
	for _, kv := range transition.Attributes() {
		attrs[string(kv.Key)] = kv.Value.String()
	}
	if attrs["messaging.system"] != "nats" || attrs["messaging.destination.name"] != "fleet.evt.proxy.demo-a.ready" || attrs["messaging.operation.type"] != "send" {
		t.Errorf("transition span attributes %v lack the messaging ones", attrs)
	}

	// The line is written inside the span, before it ends.
	want := transition.SpanContext().TraceID().String()
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			var r map[string]any
			if json.Unmarshal([]byte(l), &r) == nil && r["msg"] == "proxy ready" {
				if r["trace_id"] != want || r["span_id"] != transition.SpanContext().SpanID().String() {
					t.Fatalf("log line %v: want trace_id %s and the transition's span_id", r, want)
				}
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no \"proxy ready\" log line:\n%s", logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
