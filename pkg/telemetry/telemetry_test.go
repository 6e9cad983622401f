package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/telemetry"
)

func TestTraceContextRoundTripsThroughNATSHeaders(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, span := tp.Tracer("test").Start(context.Background(), "op")
	defer span.End()

	h := nats.Header{}
	telemetry.Inject(ctx, h)
	// NATS header keys are case-sensitive: the key must stay lowercase.
	if _, ok := h["traceparent"]; !ok {
		t.Fatalf("headers %v lack a lowercase traceparent", h)
	}
	if _, ok := h["Traceparent"]; ok {
		t.Fatalf("headers %v carry a canonicalised Traceparent", h)
	}
	got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), h))
	if got.TraceID() != span.SpanContext().TraceID() || !got.IsRemote() {
		t.Fatalf("extracted trace %s (remote %v), want %s", got.TraceID(), got.IsRemote(), span.SpanContext().TraceID())
	}
	if sc := trace.SpanContextFromContext(telemetry.Extract(context.Background(), nil)); sc.IsValid() {
		t.Fatal("nil headers produced a span context")
	}
}

func TestLoggerStampsTraceIDs(t *testing.T) {
	var buf bytes.Buffer
	log := telemetry.NewLogger(&buf, slog.LevelInfo, "svc")
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, span := tp.Tracer("test").Start(context.Background(), "op")
	log.InfoContext(ctx, "hello", "proxy", "p1")
	span.End()
	log.Debug("not at info")

	var rec map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &rec); err != nil {
		t.Fatalf("one JSON record expected, got %q: %v", buf.String(), err)
	}
	if rec["trace_id"] != span.SpanContext().TraceID().String() || rec["service"] != "svc" || rec["proxy"] != "p1" {
		t.Fatalf("record %v lacks the trace id, service or attributes", rec)
	}
}

func TestSetupWithoutExporterIsNoop(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tel.Close(context.Background()) }()
	_, span := tel.Tracer.Start(context.Background(), "x")
	if span.SpanContext().IsValid() {
		t.Fatal("tracing is on with no exporter configured")
	}
	c, _ := tel.Meter.Int64Counter("proxyfleet_test_total")
	c.Add(context.Background(), 2)
	resp, err := http.Get("http://" + tel.MetricsAddr + "/metrics")
	if err != nil {
		t.Fatalf("metrics endpoint: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !strings.Contains(string(body), "proxyfleet_test_total") {
		t.Fatalf("metrics endpoint: %d, body lacks the counter:\n%s", resp.StatusCode, body)
	}
}
