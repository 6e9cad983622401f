package projection_test

import (
	"context"
	"testing"

	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/projection"
)

// TestProjectionJoinsTheAppendersTrace: the span of an event's projection
// is a child of the span that appended it, linked to the span of its
// batch.
func TestProjectionJoinsTheAppendersTrace(t *testing.T) {
	e := open(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tracer := tp.Tracer("test")

	ctx, parent := tracer.Start(e.ctx, "planner.decide")
	seq, err := bus.NewEventStore(e.conn, events.SourcePlanner, nil).Append(ctx, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", requested("demo"), nil)
	if err != nil {
		t.Fatal(err)
	}
	parent.End()
	// An event appended without a trace gets no span of its own.
	e.append("p2", events.ProxyRequested, requested("demo"))

	rctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() {
		done <- projection.New(e.conn, nil, &telemetry.Telemetry{Tracer: tp.Tracer("health"), Meter: metricnoop.NewMeterProvider().Meter("")}).Run(rctx)
	}()
	e.waitProxy("p1", seq)
	e.caughtUp()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	var projected, batches []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		switch s.Name() {
		case "health.project":
			projected = append(projected, s)
		case "health.project.batch":
			batches = append(batches, s)
		}
	}
	if len(projected) != 1 || len(batches) == 0 {
		t.Fatalf("%d event spans and %d batch spans; want 1 and some", len(projected), len(batches))
	}
	s := projected[0]
	if s.Parent().SpanID() != parent.SpanContext().SpanID() || s.SpanContext().TraceID() != parent.SpanContext().TraceID() {
		t.Errorf("event span %v has parent %v; want a child of %v", s.SpanContext(), s.Parent(), parent.SpanContext())
	}
	if s.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("event span kind %v; want consumer", s.SpanKind())
	}
	linked := false
	for _, l := range s.Links() {
		for _, b := range batches {
			linked = linked || l.SpanContext.SpanID() == b.SpanContext().SpanID()
		}
	}
	if !linked {
		t.Errorf("event span links %v; want its batch's span", s.Links())
	}
}
