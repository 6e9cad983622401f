package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/health/internal/probe"
	"proxyfleet/services/health/internal/projection"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParseFlags(t *testing.T) {
	f, err := parse([]string{"--nats-url", "nats://127.0.0.1:4222", "--data-dir", "d", "--probe-interval", "2s", "--unhealthy-after", "5"})
	if err != nil {
		t.Fatal(err)
	}
	if f.base.NATSURL != "nats://127.0.0.1:4222" || f.base.DataDir != "d" || f.probeInterval != 2*time.Second ||
		f.unhealthyAfter != 5 || f.probeTimeout != 3*time.Second || f.probeConc != 0 || f.echoAddr != "127.0.0.1:8480" || f.checkInterval != 30*time.Second {
		t.Fatalf("parsed %+v", f)
	}
	if _, err := parse([]string{"--echo-addr", ""}); err == nil {
		t.Fatal("no echo at all: want an error")
	}
	if f, err := parse([]string{"--probe-concurrency", "200"}); err != nil || f.probeConc != 200 {
		t.Fatalf("--probe-concurrency 200: got %+v, %v", f, err)
	}
	if _, err := parse([]string{"--probe-concurrency", "-1"}); err == nil {
		t.Fatal("negative concurrency: want an error")
	}
	if _, err := parse([]string{"stray"}); err == nil {
		t.Fatal("stray argument: want an error")
	}
	if f, err := parse([]string{"--replica-id", "health-2"}); err != nil || f.replicaID != "health-2" {
		t.Fatalf("--replica-id health-2: got %+v, %v", f, err)
	}
	for _, bad := range []string{"", "a b", "a..b", "health/2"} {
		if _, err := parse([]string{"--replica-id", bad}); err == nil || !strings.Contains(err.Error(), "--replica-id") {
			t.Fatalf("--replica-id %q: got %v, want an error naming the flag", bad, err)
		}
	}
	if err := probe.CheckReplica(f.replicaID); err != nil {
		t.Fatalf("default replica id %q: %v", f.replicaID, err)
	}
	if f.compactEvery != time.Hour || f.compactAfter != 24*time.Hour {
		t.Fatalf("compaction defaults: every %s, after %s; want 1h and 24h", f.compactEvery, f.compactAfter)
	}
	if f, err := parse([]string{"--compact-every", "0", "--compact-after", "2h"}); err != nil || f.compactEvery != 0 || f.compactAfter != 2*time.Hour {
		t.Fatalf("--compact-every 0 --compact-after 2h: got %+v, %v", f, err)
	}
	for _, bad := range [][]string{{"--compact-every", "-1s"}, {"--compact-after", "59m"}, {"--compact-after", "0"}} {
		if _, err := parse(bad); err == nil || !strings.Contains(err.Error(), bad[0]) {
			t.Fatalf("%v: got %v, want an error naming the flag", bad, err)
		}
	}
}

// build builds the health binary and returns its path.
func build(ctx context.Context, t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "health")
	if out, err := exec.CommandContext(ctx, "go", "build", "-tags", "grpcnotrace", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	return bin
}

// healthProc is a health binary the test runs.
type healthProc struct {
	name   string
	cmd    *exec.Cmd
	out    *testwait.Buffer // its output
	exited chan struct{}    // closed once it has exited; err is then its Wait's
	err    error
}

// startHealth runs bin with args as name; if it still runs when the test
// ends, it is killed.
func startHealth(t *testing.T, name, bin string, args ...string) *healthProc {
	t.Helper()
	p := &healthProc{name: name, out: &testwait.Buffer{}, exited: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
	})
	return p
}

// stop sends SIGTERM and fails t unless the process exits cleanly before
// ctx ends.
func (p *healthProc) stop(ctx context.Context, t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.exited:
		if p.err != nil {
			t.Fatalf("%s exited with %v\n%s", p.name, p.err, p.out)
		}
	case <-ctx.Done():
		t.Fatalf("%s did not stop on SIGTERM\n%s", p.name, p.out)
	}
}

// TestBinaryProjectsRebuildsAndStops runs the real binary against a NATS
// server: it projects the log and probes, stops cleanly on SIGTERM, and
// `health --rebuild-views` replays the log into identical views and exits.
func TestBinaryProjectsRebuildsAndStops(t *testing.T) {
	ctx := testwait.Context(t, 120*time.Second)
	bin := build(ctx, t)
	c := bustest.Start(t)
	appendEv := func(agg, id, kind string, data any) {
		t.Helper()
		if _, err := bus.NewEventStore(c, bustest.Source(agg, kind), nil).Append(ctx, agg, id, kind, id+"."+kind, data, nil); err != nil {
			t.Fatal(err)
		}
	}
	appendEv(events.AggregatePool, "demo", events.PoolApplied, events.PoolAppliedData{
		Spec: events.PoolSpec{Name: "demo", Provider: "local", Size: 2, Port: 3128}, Revision: 1})
	for _, id := range []string{"demo-a", "demo-b"} {
		appendEv(events.AggregateProxy, id, events.ProxyRequested, events.ProxyRequestedData{
			ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128},
		})
	}
	// Nothing listens here any more: the proxy, ready once, is probed and
	// found unhealthy.
	addr := testnet.Refusing(t).String()
	appendEv(events.AggregateProxy, "demo-a", events.ProxyRunning, events.ProxyRunningData{Address: addr, Attempt: 1})
	appendEv(events.AggregateProxy, "demo-a", events.ProxyReady, events.ProxyReadyData{Address: addr})

	h := startHealth(t, "health", bin, "--nats-url", c.ClientURL(), "--data-dir", t.TempDir(),
		"--echo-addr", "127.0.0.1:0", "--probe-interval", "50ms", "--probe-timeout", "500ms", "--check-interval", "1s",
		"--metrics-addr", "127.0.0.1:0")
	out := h.out
	eventually := func(what string, cond func() bool) {
		t.Helper()
		err := testwait.For(ctx, func() bool {
			if cond() {
				return true
			}
			select {
			case <-h.exited:
				t.Fatalf("health exited (%v) while waiting for %s\n%s", h.err, what, out)
			default:
			}
			return false
		})
		if err != nil {
			t.Fatalf("timed out waiting for %s\n%s", what, out)
		}
	}
	proxies, err := c.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	state := func(id string) string {
		e, err := proxies.Get(ctx, id)
		if err != nil {
			return ""
		}
		var v projection.Proxy
		_ = json.Unmarshal(e.Value(), &v)
		return v.State
	}

	eventually("demo-a unhealthy", func() bool { return state("demo-a") == events.ProxyUnhealthy })
	eventually("demo-b requested", func() bool { return state("demo-b") == events.ProxyRequested })

	// The metrics docs/observability.md lists for health, as scraped.
	metricsAddr := ""
	eventually("the metrics endpoint's address in the log", func() bool {
		metricsAddr = logValue(out.String(), "metrics endpoint serving", "addr")
		return metricsAddr != ""
	})
	want := []string{
		`proxyfleet_health_probes_total{`, `outcome="fail"`,
		`proxyfleet_health_probe_duration_seconds_bucket{`, `le="0.005"`,
		`proxyfleet_health_transitions_total{`, `kind="unhealthy"`,
		`proxyfleet_health_projection_events_total{`, `aggregate="proxy"`,
		// Once the views caught up with the log.
		`proxyfleet_health_projection_lag_events{`, `} 0`,
		`proxyfleet_consumer_pending_messages{`, `consumer="health-projection"`,
		`proxyfleet_consumer_ack_pending_messages{`, `stream="FLEET_EVENTS"`,
		`go_goroutines `, ``,
		`process_resident_memory_bytes `, ``,
	}
	var scraped string
	eventually("health's metrics", func() bool {
		scraped = scrape(t, metricsAddr)
		for i := 0; i < len(want); i += 2 {
			if !hasMetric(scraped, want[i], want[i+1]) {
				return false
			}
		}
		return true
	})
	if strings.Contains(scraped, "proxyfleet_health_probe_latency") || strings.Contains(scraped, "milliseconds") {
		t.Errorf("health still exports milliseconds:\n%s", scraped)
	}
	h.stop(ctx, t)
	if !strings.Contains(out.String(), "health stopped") {
		t.Fatalf("no clean stop in the log:\n%s", out)
	}
	before := dump(t, ctx, c)
	if len(before) != 3 {
		t.Fatalf("views: got %d keys, want 3 (2 proxies, 1 pool)", len(before))
	}

	// One-shot rebuild: drops the views, replays, exits 0.
	rb := exec.CommandContext(ctx, bin, "--nats-url", c.ClientURL(), "--data-dir", t.TempDir(), "--rebuild-views")
	outRB, err := rb.CombinedOutput()
	if err != nil {
		t.Fatalf("health --rebuild-views: %v\n%s", err, outRB)
	}
	if !strings.Contains(string(outRB), "views rebuilt") {
		t.Fatalf("--rebuild-views did not report a rebuild:\n%s", outRB)
	}
	after := dump(t, ctx, c)
	for k := range mergeKeys(before, after) {
		if !bytes.Equal(after[k], before[k]) {
			t.Errorf("%s after rebuild:\n got  %s\n want %s", k, after[k], before[k])
		}
	}
}

func mergeKeys(a, b map[string][]byte) map[string]bool {
	out := map[string]bool{}
	for k := range a {
		out[k] = true
	}
	for k := range b {
		out[k] = true
	}
	return out
}

func dump(t *testing.T, ctx context.Context, c *bus.Conn) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for _, b := range []string{bus.BucketProxies, bus.BucketPools} {
		kv, err := c.JS.KeyValue(ctx, b)
		if err != nil {
			continue // being recreated
		}
		keys, err := kv.Keys(ctx)
		if err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) {
			continue
		}
		for _, k := range keys {
			if e, err := kv.Get(ctx, k); err == nil {
				out[b+"/"+k] = e.Value()
			}
		}
	}
	return out
}

// TestTwoReplicasSplitTheFleet runs two health binaries with their own
// --replica-id: both join fleet-health and split the proxies between them;
// one stopped with SIGTERM leaves at once and the other takes its proxies.
func TestTwoReplicasSplitTheFleet(t *testing.T) {
	ctx := testwait.Context(t, 120*time.Second)
	bin := build(ctx, t)
	c := bustest.Start(t)
	const n = 12
	refusing := testnet.Refusing(t).String()
	for i := range n {
		id := fmt.Sprintf("demo-%02d", i)
		for _, ev := range []struct {
			kind string
			data any
		}{
			{events.ProxyRequested, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128}}},
			{events.ProxyRunning, events.ProxyRunningData{Address: refusing, Attempt: 1}},
		} {
			if _, err := bus.NewEventStore(c, bustest.Source(events.AggregateProxy, ev.kind), nil).Append(ctx, events.AggregateProxy, id, ev.kind, id+"."+ev.kind, ev.data, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	start := func(replica string) *healthProc {
		return startHealth(t, replica, bin, "--nats-url", c.ClientURL(), "--data-dir", t.TempDir(), "--replica-id", replica,
			"--echo-addr", "127.0.0.1:0", "--probe-interval", "100ms", "--probe-timeout", "500ms", "--check-interval", "1s")
	}
	one, two := start("health-1"), start("health-2")
	members, err := c.JS.KeyValue(ctx, bus.BucketHealth)
	if err != nil {
		t.Fatal(err)
	}
	// probing reads each live replica's count of the proxies it probes.
	probing := func() map[string]int {
		out := map[string]int{}
		keys, _ := members.Keys(ctx)
		for _, k := range keys {
			if e, err := members.Get(ctx, k); err == nil {
				var v struct {
					Proxies int `json:"proxies"`
				}
				_ = json.Unmarshal(e.Value(), &v)
				out[k] = v.Proxies
			}
		}
		return out
	}
	eventually := func(what string, cond func() bool) {
		t.Helper()
		if testwait.For(ctx, cond) != nil {
			t.Fatalf("timed out waiting for %s; members %v\nhealth-1:\n%s\nhealth-2:\n%s", what, probing(), one.out, two.out)
		}
	}
	eventually("both replicas probing a share each", func() bool {
		p := probing()
		return len(p) == 2 && p["health-1"] > 0 && p["health-2"] > 0 && p["health-1"]+p["health-2"] == n
	})

	two.stop(ctx, t)
	// It deleted its key before exiting: no waiting for the TTL.
	if keys, err := members.Keys(ctx); err != nil || len(keys) != 1 || keys[0] != "health-1" {
		t.Fatalf("members after health-2 stopped: %v (%v), want health-1 alone", keys, err)
	}
	eventually("health-1 probing every proxy", func() bool { return probing()["health-1"] == n })
}

// logValue returns the value of key in the last JSON log line of out whose
// message is msg, or "".
func logValue(out, msg, key string) string {
	v := ""
	for _, l := range strings.Split(out, "\n") {
		var r map[string]any
		if json.Unmarshal([]byte(l), &r) == nil && r["msg"] == msg {
			v, _ = r[key].(string)
		}
	}
	return v
}

// scrape reads the Prometheus endpoint at addr ("" when it does not answer).
func scrape(t *testing.T, addr string) string {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// hasMetric reports whether a line of body starts with prefix and holds
// part.
func hasMetric(body, prefix, part string) bool {
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, prefix) && strings.Contains(l, part) {
			return true
		}
	}
	return false
}
