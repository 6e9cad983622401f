package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"

	"proxyfleet/pkg/telemetry"
	"proxyfleet/pkg/testwait"
)

// clearOTel unsets every OTEL_* variable Setup reads, for one test.
func clearOTel(t *testing.T) {
	t.Helper()
	for _, k := range []string{
		"OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
		"OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
		"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
	} {
		t.Setenv(k, "")
	}
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("metrics endpoint: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("metrics endpoint: status %d:\n%s", resp.StatusCode, body)
	}
	return string(body)
}

func TestMetricsEndpointServesRuntimeAndProcessMetrics(t *testing.T) {
	clearOTel(t)
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tel.Close(context.Background()) }()
	body := scrape(t, tel.MetricsAddr)
	for _, want := range []string{"\ngo_goroutines ", "\nprocess_resident_memory_bytes ", "\ngo_memstats_heap_alloc_bytes ", `service_name="proxyfleet-t"`} {
		if !strings.Contains(body, want) {
			t.Errorf("scrape lacks %q:\n%s", want, body)
		}
	}
}

func TestServiceNameFromEnvironment(t *testing.T) {
	clearOTel(t)
	t.Setenv("OTEL_SERVICE_NAME", "planner-eu1")
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "planner", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tel.Close(context.Background()) }()
	body := scrape(t, tel.MetricsAddr)
	if !strings.Contains(body, `service_name="planner-eu1"`) || strings.Contains(body, `service_name="proxyfleet-planner"`) {
		t.Fatalf("target_info does not name the service planner-eu1:\n%s", body)
	}
}

func TestSetupRefusesUnknownSettings(t *testing.T) {
	for _, c := range []struct{ env, value, want string }{
		{"OTEL_EXPORTER_OTLP_PROTOCOL", "udp", "OTEL_EXPORTER_OTLP_PROTOCOL=\"udp\""},
		{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=\"http/json\""},
		{"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpcs", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL=\"grpcs\""},
		{"OTEL_TRACES_EXPORTER", "zipkin", "OTEL_TRACES_EXPORTER=\"zipkin\""},
		{"OTEL_METRICS_EXPORTER", "otlp,console", "OTEL_METRICS_EXPORTER=\"otlp,console\""},
	} {
		t.Run(c.env, func(t *testing.T) {
			clearOTel(t)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
			t.Setenv(c.env, c.value)
			tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t"})
			if err == nil {
				_ = tel.Close(context.Background())
				t.Fatalf("Setup with %s=%s succeeded", c.env, c.value)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q does not name %s", err, c.want)
			}
		})
	}
}

func TestExporterChoice(t *testing.T) {
	for _, c := range []struct {
		name          string
		env           map[string]string
		traces, metrs []string
	}{
		{"nothing set", nil, nil, nil},
		{"endpoint: http", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
			[]string{telemetry.ExporterOTLPHTTP}, []string{telemetry.ExporterOTLPHTTP}},
		{"grpc", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
			[]string{telemetry.ExporterOTLPGRPC}, []string{telemetry.ExporterOTLPGRPC}},
		{"per-signal protocol wins", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf"},
			[]string{telemetry.ExporterOTLPGRPC}, []string{telemetry.ExporterOTLPHTTP}},
		{"traces none", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"},
			nil, []string{telemetry.ExporterOTLPHTTP}},
		{"metrics prometheus only", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces", "OTEL_METRICS_EXPORTER": "prometheus"},
			[]string{telemetry.ExporterOTLPHTTP}, nil},
		{"console", map[string]string{"OTEL_TRACES_EXPORTER": "console"}, []string{telemetry.ExporterConsole}, nil},
		{"sdk disabled", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"}, nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			clearOTel(t)
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t"})
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
				defer cancel()
				_ = tel.Close(ctx)
			}()
			if !equal(tel.TraceExporters, c.traces) || !equal(tel.MetricExporters, c.metrs) {
				t.Fatalf("exporters: traces %v, metrics %v; want %v, %v", tel.TraceExporters, tel.MetricExporters, c.traces, c.metrs)
			}
			_, span := tel.Tracer.Start(context.Background(), "x")
			if got := span.SpanContext().IsValid(); got != (len(c.traces) > 0) {
				t.Fatalf("span recorded %v with trace exporters %v", got, c.traces)
			}
		})
	}
}

func equal(a, b []string) bool { return strings.Join(a, ",") == strings.Join(b, ",") }

// traceReceiver is an OTLP/gRPC trace collector on loopback that keeps the
// names of the spans it receives.
type traceReceiver struct {
	coltrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	names []string
}

func (r *traceReceiver) Export(_ context.Context, req *coltrace.ExportTraceServiceRequest) (*coltrace.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				r.names = append(r.names, s.GetName())
			}
		}
	}
	return &coltrace.ExportTraceServiceResponse{}, nil
}

func (r *traceReceiver) got() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.names...)
}

func TestOTLPGRPCExportsSpans(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	recv := &traceReceiver{}
	coltrace.RegisterTraceServiceServer(srv, recv)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	clearOTel(t)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://"+ln.Addr().String())
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	t.Setenv("OTEL_METRICS_EXPORTER", "none")
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t"})
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.Tracer.Start(context.Background(), "grpc-op")
	span.End()
	ctx := testwait.Context(t, 20*time.Second)
	if err := tel.Close(ctx); err != nil {
		t.Fatalf("flush to the gRPC receiver: %v", err)
	}
	if got := recv.got(); len(got) != 1 || got[0] != "grpc-op" {
		t.Fatalf("receiver got spans %v; want [grpc-op]", got)
	}
}

func TestOTLPHTTPExportsSpans(t *testing.T) {
	var mu sync.Mutex
	var paths []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer srv.Close()

	clearOTel(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", srv.URL)
	t.Setenv("OTEL_METRICS_EXPORTER", "none")
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t"})
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.Tracer.Start(context.Background(), "http-op")
	span.End()
	ctx := testwait.Context(t, 20*time.Second)
	if err := tel.Close(ctx); err != nil {
		t.Fatalf("flush to the HTTP receiver: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(paths) != 1 || paths[0] != "/v1/traces" {
		t.Fatalf("receiver got requests %v; want one to /v1/traces", paths)
	}
}

// TestSDKErrorsAreJSONLogLines: what the SDK reports goes through the
// service's logger, not as plain text on stderr.
func TestSDKErrorsAreJSONLogLines(t *testing.T) {
	clearOTel(t)
	var buf bytes.Buffer
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "t", Log: telemetry.NewLogger(&buf, slog.LevelInfo, "t")})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tel.Close(context.Background()) }()
	otel.Handle(errors.New("exporter said no"))
	var rec map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &rec); err != nil {
		t.Fatalf("one JSON record expected, got %q: %v", buf.String(), err)
	}
	if rec["level"] != "ERROR" || rec["err"] != "exporter said no" || rec["service"] != "t" {
		t.Fatalf("record %v: want level ERROR, err and service", rec)
	}
}
