// Package telemetry sets up OpenTelemetry tracing and metrics, carries trace
// context through NATS headers, and builds the JSON slog logger that stamps
// every record with the active trace and span ids.
//
// Exporters follow the standard OTEL_* environment variables: with
// OTEL_EXPORTER_OTLP_ENDPOINT (or the per-signal variants) set, traces and
// metrics go out over OTLP/HTTP; with nothing set, tracing is a no-op and
// metrics are only served on the Prometheus endpoint when one is asked for.
package telemetry

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Config selects what [Setup] builds.
type Config struct {
	// Service is the OTel service.name, e.g. "planner".
	Service string
	// MetricsAddr, when set, serves Prometheus metrics at http://addr/metrics.
	MetricsAddr string
}

// Telemetry holds the providers of one process. Close flushes and stops them.
type Telemetry struct {
	Tracer trace.Tracer
	Meter  metric.Meter
	// TracerProvider is exposed so tests can install a recording provider.
	TracerProvider trace.TracerProvider
	// MetricsAddr is the address the Prometheus endpoint listens on, if any.
	MetricsAddr string

	shutdown []func(context.Context) error
}

// Setup builds tracer and meter providers for cfg.Service and installs the W3C
// trace-context propagator globally.
func Setup(ctx context.Context, cfg Config) (*Telemetry, error) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	res := resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName("proxyfleet-"+cfg.Service))
	t := &Telemetry{}

	if otlpConfigured("TRACES") {
		exp, err := otlptracehttp.New(ctx)
		if err != nil {
			return nil, err
		}
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
		t.TracerProvider = tp
		t.shutdown = append(t.shutdown, tp.Shutdown)
	} else {
		t.TracerProvider = noop.NewTracerProvider()
	}
	otel.SetTracerProvider(t.TracerProvider)
	t.Tracer = t.TracerProvider.Tracer("proxyfleet/" + cfg.Service)

	var readers []sdkmetric.Option
	if otlpConfigured("METRICS") {
		exp, err := otlpmetrichttp.New(ctx)
		if err != nil {
			return nil, err
		}
		readers = append(readers, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)))
	}
	if cfg.MetricsAddr != "" {
		reg := prometheus.NewRegistry()
		exp, err := otelprom.New(otelprom.WithRegisterer(reg))
		if err != nil {
			return nil, err
		}
		readers = append(readers, sdkmetric.WithReader(exp))
		ln, err := net.Listen("tcp", cfg.MetricsAddr)
		if err != nil {
			return nil, err
		}
		t.MetricsAddr = ln.Addr().String()
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.shutdown = append(t.shutdown, srv.Shutdown)
	}
	mp := sdkmetric.NewMeterProvider(append(readers, sdkmetric.WithResource(res))...)
	otel.SetMeterProvider(mp)
	t.shutdown = append(t.shutdown, mp.Shutdown)
	t.Meter = mp.Meter("proxyfleet/" + cfg.Service)
	return t, nil
}

// Close flushes exporters and stops the metrics endpoint.
func (t *Telemetry) Close(ctx context.Context) error {
	var errs []error
	for i := len(t.shutdown) - 1; i >= 0; i-- {
		errs = append(errs, t.shutdown[i](ctx))
	}
	return errors.Join(errs...)
}

func otlpConfigured(signal string) bool {
	if os.Getenv("OTEL_SDK_DISABLED") == "true" {
		return false
	}
	if v := os.Getenv("OTEL_" + signal + "_EXPORTER"); v == "none" {
		return false
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" ||
		os.Getenv("OTEL_EXPORTER_OTLP_"+signal+"_ENDPOINT") != ""
}
