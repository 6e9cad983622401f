package agent_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/pkg/testwait"
)

// scrapeUntil scrapes the Prometheus endpoint at addr until every line
// prefix of want appears, and returns the last scrape.
func scrapeUntil(t *testing.T, addr string, want ...string) string {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	var body string
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := client.Get("http://" + addr + "/metrics")
		if err != nil {
			t.Fatalf("scrape: %v", err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		body = string(b)
		var missing []string
		for _, w := range want {
			if !hasLine(body, w) {
				missing = append(missing, w)
			}
		}
		if len(missing) == 0 {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics endpoint lacks lines starting %q; scraped:\n%s", missing, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// hasLine reports whether a line of body starts with name and holds every
// label given after it, as in `name{a="1",b="2"`.
func hasLine(body, want string) bool {
	name, labels, _ := strings.Cut(want, "{")
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		ok := true
		for _, lv := range strings.Split(labels, ",") {
			if lv != "" && !strings.Contains(l, lv) {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// TestMetricsTracesAndLogs runs an agent with a real metrics endpoint, a
// recording tracer and a JSON logger: the metrics carry the names and
// labels docs/observability.md lists, durations in seconds with buckets up
// to 20 min; the command spans carry messaging attributes and a failed
// command's span is an error; a log line of a command carries its span's
// trace id.
func TestMetricsTracesAndLogs(t *testing.T) {
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_SERVICE_NAME"} {
		t.Setenv(k, "")
	}
	tel, err := telemetry.Setup(context.Background(), telemetry.Config{Service: "agent-test", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Close(context.Background()) })
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	var logs testwait.Buffer

	c := bustest.Start(t)
	d := newMemDriver()
	d.createErrs = []error{agent.Wrap(agent.ErrPermanent, errors.New("bad image"))}
	rt, err := agent.New(bustest.Dial(t, c), d, agent.Config{
		Info:          agent.Info{Entry: "mem", Target: "t1", Type: "memory"},
		WatchInterval: 10 * time.Millisecond, HeartbeatInterval: 100 * time.Millisecond,
		RecheckInterval: 50 * time.Millisecond, Meter: tel.Meter, ConsumerMetricsInterval: 50 * time.Millisecond,
	}, telemetry.NewLogger(&logs, slog.LevelInfo, "agent-test"), tp.Tracer("agent"))
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Serve(t, rt.Run)

	h := &harness{t: t, conn: c, store: bus.NewEventStore(c, "test", nil), drv: d}
	h.create("m-1", 1) // fails: the driver's first create errs
	h.waitFor("m-1", events.ProxyFailed)
	h.create("m-2", 1)
	h.waitFor("m-2", events.ProxyRunning)
	h.waitQueueEmpty()

	body := scrapeUntil(t, tel.MetricsAddr,
		`proxyfleet_agent_commands_total{entry="mem",outcome="done",target="t1",verb="create"`,
		`proxyfleet_agent_commands_total{outcome="failed",verb="create"`,
		`proxyfleet_agent_command_duration_seconds_bucket{le="0.005",verb="create"`,
		`proxyfleet_agent_command_duration_seconds_bucket{le="1200",verb="create"`,
		`proxyfleet_agent_command_duration_seconds_count{verb="create"`,
		`proxyfleet_agent_driver_call_duration_seconds_bucket{le="0.005",op="create"`,
		`proxyfleet_agent_driver_call_duration_seconds_count{op="create",outcome="error"`,
		`proxyfleet_agent_driver_call_duration_seconds_count{op="inventory",outcome="ok"`,
		`proxyfleet_consumer_pending_messages{consumer="agent-mem-t1",stream="FLEET_CMDS"`,
		`proxyfleet_consumer_ack_pending_messages{consumer="agent-mem-t1",stream="FLEET_CMDS"`,
		`go_goroutines`, `process_resident_memory_bytes`,
	)
	if hasLine(body, `proxyfleet_agent_command_duration_milliseconds`) || hasLine(body, `proxyfleet_agent_command_duration_seconds_bucket{le="5000"`) {
		t.Errorf("command durations are not in seconds:\n%s", body)
	}

	var created, failed *sdktrace.ReadOnlySpan
	publishes := 0
	for _, s := range rec.Ended() {
		attrs := map[string]string{}
		for _, kv := range s.Attributes() {
			attrs[string(kv.Key)] = kv.Value.String()
		}
		switch {
		case s.Name() == "agent.create" && attrs["proxy"] == "m-2":
			created = &s
			if attrs["messaging.system"] != "nats" || attrs["messaging.operation.type"] != "process" ||
				attrs["messaging.destination.name"] != events.CommandSubject("mem", "t1", events.VerbCreate) {
				t.Errorf("create span attributes %v lack the messaging ones", attrs)
			}
			if s.Status().Code == codes.Error {
				t.Errorf("span of a command done has status %v", s.Status())
			}
		case s.Name() == "agent.create" && attrs["proxy"] == "m-1":
			failed = &s
			if s.Status().Code != codes.Error {
				t.Errorf("span of a failed command has status %v; want Error", s.Status())
			}
		case s.Name() == "agent.publish":
			publishes++
			if attrs["messaging.system"] != "nats" || attrs["messaging.operation.type"] != "send" || !strings.HasPrefix(attrs["messaging.destination.name"], "fleet.") {
				t.Errorf("publish span attributes %v lack the messaging ones", attrs)
			}
		}
	}
	if created == nil || failed == nil || publishes < 3 {
		t.Fatalf("spans: create m-2 %v, create m-1 %v, %d publishes; want both and 3 or more publishes", created != nil, failed != nil, publishes)
	}
	traceID := (*created).SpanContext().TraceID().String()
	found := false
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var r map[string]any
		if json.Unmarshal([]byte(l), &r) != nil {
			t.Fatalf("log line is not JSON: %q", l)
		}
		if r["msg"] == "proxy running" && r["proxy"] == "m-2" {
			found = true
			if r["trace_id"] != traceID || r["span_id"] == nil {
				t.Errorf("log line %v: want trace_id %s and a span_id", r, traceID)
			}
		}
	}
	if !found {
		t.Fatalf("no \"proxy running\" line for m-2 in the logs:\n%s", logs.String())
	}
}
