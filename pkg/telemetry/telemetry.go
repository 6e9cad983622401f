// Package telemetry sets up OpenTelemetry tracing and metrics, carries trace
// context through NATS headers, and builds the JSON slog logger that stamps
// every record with the active trace and span ids.
//
// Exporters follow the standard OTEL_* environment variables (see
// [Setup]): with OTEL_EXPORTER_OTLP_ENDPOINT (or the per-signal variants)
// set, traces and metrics go out over OTLP, by HTTP/protobuf unless
// OTEL_EXPORTER_OTLP_PROTOCOL says grpc; with nothing set, tracing is a
// no-op and metrics are only served on the Prometheus endpoint when one is
// asked for.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetricgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
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
	// Service names the service, e.g. "planner"; its OTel service.name is
	// "proxyfleet-<Service>" unless OTEL_SERVICE_NAME says otherwise.
	Service string
	// MetricsAddr, when set, serves Prometheus metrics at http://addr/metrics.
	MetricsAddr string
	// Log receives the errors and warnings of the OpenTelemetry SDK and its
	// exporters, so that they are JSON lines like the service's own. Nil
	// discards them.
	Log *slog.Logger
}

// Telemetry holds the providers of one process. Close flushes and stops them.
type Telemetry struct {
	Tracer trace.Tracer
	Meter  metric.Meter
	// TracerProvider is exposed so tests can install a recording provider.
	TracerProvider trace.TracerProvider
	// MetricsAddr is the address the Prometheus endpoint listens on, if any.
	MetricsAddr string
	// TraceExporters and MetricExporters name the exporters Setup chose,
	// e.g. ["otlp/grpc"], or none.
	TraceExporters, MetricExporters []string

	shutdown []func(context.Context) error
}

// Exporter names in [Telemetry.TraceExporters] and [Telemetry.MetricExporters].
const (
	ExporterOTLPHTTP = "otlp/http"
	ExporterOTLPGRPC = "otlp/grpc"
	ExporterConsole  = "console"
)

// Setup builds tracer and meter providers for cfg.Service, installs them and
// the W3C trace-context propagator globally, and routes the SDK's errors
// and internal log to cfg.Log.
//
// It honours OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES;
// OTEL_SDK_DISABLED=true; OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER
// ("otlp", "none", and "console" for traces, comma-separated; unset means
// otlp when an OTLP endpoint is set, else none); and
// OTEL_EXPORTER_OTLP_PROTOCOL with its per-signal variants
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL and OTEL_EXPORTER_OTLP_METRICS_PROTOCOL
// ("http/protobuf", the default, or "grpc"). The exporters read their
// endpoint, headers and timeouts from the OTEL_EXPORTER_OTLP_* variables
// themselves. A value Setup does not know is an error naming the variable.
func Setup(ctx context.Context, cfg Config) (*Telemetry, error) {
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Error("opentelemetry", "err", err)
	}))
	otel.SetLogger(logr.FromSlogHandler(log.With("component", "opentelemetry").Handler()))
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName("proxyfleet-"+cfg.Service)),
		// Last, so OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win.
		resource.WithFromEnv())
	if err != nil {
		return nil, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES or OTEL_SERVICE_NAME: %w", err)
	}
	t := &Telemetry{}
	ok := false
	defer func() {
		if !ok {
			_ = t.Close(context.Background())
		}
	}()

	traceExps, err := exporters("TRACES", "otlp", "none", "console")
	if err != nil {
		return nil, err
	}
	var spanOpts []sdktrace.TracerProviderOption
	for _, name := range traceExps {
		var exp sdktrace.SpanExporter
		switch name {
		case "otlp":
			proto, err := protocol("TRACES")
			if err != nil {
				return nil, err
			}
			if proto == "grpc" {
				exp, err = otlptracegrpc.New(ctx)
				name = ExporterOTLPGRPC
			} else {
				exp, err = otlptracehttp.New(ctx)
				name = ExporterOTLPHTTP
			}
			if err != nil {
				return nil, fmt.Errorf("trace exporter %s: %w", name, err)
			}
		case "console":
			if exp, err = stdouttrace.New(stdouttrace.WithWriter(os.Stdout)); err != nil {
				return nil, err
			}
			name = ExporterConsole
		}
		t.TraceExporters = append(t.TraceExporters, name)
		spanOpts = append(spanOpts, sdktrace.WithBatcher(exp))
	}
	if len(spanOpts) > 0 {
		tp := sdktrace.NewTracerProvider(append(spanOpts, sdktrace.WithResource(res))...)
		t.TracerProvider = tp
		t.shutdown = append(t.shutdown, tp.Shutdown)
	} else {
		t.TracerProvider = noop.NewTracerProvider()
	}
	otel.SetTracerProvider(t.TracerProvider)
	t.Tracer = t.TracerProvider.Tracer("proxyfleet/" + cfg.Service)

	metricExps, err := exporters("METRICS", "otlp", "none", "prometheus")
	if err != nil {
		return nil, err
	}
	var readers []sdkmetric.Option
	for _, name := range metricExps {
		if name != "otlp" {
			// "prometheus" is the endpoint of cfg.MetricsAddr.
			continue
		}
		proto, err := protocol("METRICS")
		if err != nil {
			return nil, err
		}
		var exp sdkmetric.Exporter
		if proto == "grpc" {
			exp, err = otlpmetricgrpc.New(ctx)
			name = ExporterOTLPGRPC
		} else {
			exp, err = otlpmetrichttp.New(ctx)
			name = ExporterOTLPHTTP
		}
		if err != nil {
			return nil, fmt.Errorf("metric exporter %s: %w", name, err)
		}
		t.MetricExporters = append(t.MetricExporters, name)
		readers = append(readers, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)))
	}
	if cfg.MetricsAddr != "" {
		reader, err := t.serveMetrics(cfg.MetricsAddr)
		if err != nil {
			return nil, err
		}
		readers = append(readers, sdkmetric.WithReader(reader))
	}
	mp := sdkmetric.NewMeterProvider(append(readers, sdkmetric.WithResource(res))...)
	otel.SetMeterProvider(mp)
	t.shutdown = append(t.shutdown, mp.Shutdown)
	t.Meter = mp.Meter("proxyfleet/" + cfg.Service)
	ok = true
	return t, nil
}

// serveMetrics starts the Prometheus endpoint at addr: the OTel instruments
// of the returned reader, and the Go runtime and process metrics.
func (t *Telemetry) serveMetrics(addr string) (sdkmetric.Reader, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		return nil, err
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, err
	}
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics endpoint: %w", err)
	}
	t.MetricsAddr = ln.Addr().String()
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.shutdown = append(t.shutdown, srv.Shutdown)
	return exp, nil
}

// Close flushes exporters and stops the metrics endpoint.
func (t *Telemetry) Close(ctx context.Context) error {
	var errs []error
	for i := len(t.shutdown) - 1; i >= 0; i-- {
		errs = append(errs, t.shutdown[i](ctx))
	}
	t.shutdown = nil
	return errors.Join(errs...)
}

// exporters returns the exporters OTEL_<signal>_EXPORTER names, each one of
// known, without "none". Unset, it is otlp when an OTLP endpoint is set for
// the signal, and none otherwise: no exporter configured means no export.
func exporters(signal string, known ...string) ([]string, error) {
	if os.Getenv("OTEL_SDK_DISABLED") == "true" {
		return nil, nil
	}
	name := "OTEL_" + signal + "_EXPORTER"
	v := strings.TrimSpace(os.Getenv(name))
	if v == "" {
		if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_"+signal+"_ENDPOINT") == "" {
			return nil, nil
		}
		v = "otlp"
	}
	var out []string
	for _, e := range strings.Split(v, ",") {
		e = strings.TrimSpace(e)
		if !slices.Contains(known, e) {
			return nil, fmt.Errorf("%s=%q: want a comma-separated list of %s", name, v, strings.Join(known, ", "))
		}
		if e != "none" && !slices.Contains(out, e) {
			out = append(out, e)
		}
	}
	return out, nil
}

// protocol returns the OTLP protocol of signal: OTEL_EXPORTER_OTLP_<signal>_PROTOCOL,
// else OTEL_EXPORTER_OTLP_PROTOCOL, else "http/protobuf".
func protocol(signal string) (string, error) {
	name := "OTEL_EXPORTER_OTLP_" + signal + "_PROTOCOL"
	v := os.Getenv(name)
	if v == "" {
		name = "OTEL_EXPORTER_OTLP_PROTOCOL"
		v = os.Getenv(name)
	}
	switch v {
	case "", "http/protobuf":
		return "http/protobuf", nil
	case "grpc":
		return "grpc", nil
	}
	return "", fmt.Errorf("%s=%q: want http/protobuf (the default) or grpc; http/json is not supported", name, v)
}
