package probe_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/echo"
	"proxyfleet/services/health/internal/probe"
	"proxyfleet/services/health/internal/projection"
)

const (
	benchFleet  = 10_000
	benchGroups = 10 // egress IPs 127.0.0.1…127.0.0.10, 1000 proxies each
	// benchConcurrency is the concurrency of the baseline and of the
	// overloaded prober: the floor the prober sizes itself to for a
	// loopback fleet.
	benchConcurrency = 32
)

// BenchmarkProbes probes 10,000 real loopback forward proxies (ten egress
// addresses of 1000 proxies each) against a loopback echo endpoint.
//
//   - baseline: the two checks of a probe ([probe.Check]) in a tight loop
//     over the fleet, 32 at a time: no scheduler, no KV.
//   - scheduled: the prober with an interval so short that every proxy is
//     always due, 32 probes in flight: its capability, scheduler, view
//     watch and probe records included. x-baseline is its probes/s as a
//     fraction of the baseline's.
//   - fleet-15s: the prober as deployed, concurrency sized for the fleet,
//     15s interval, from its first probe until it probed 20,000 times (the
//     first round is spread over one interval, each proxy's second probe
//     follows its first by 12–18 s). p99-late-ms is the 99th percentile
//     of how late probes started, read from the prober's lateness
//     histogram.
//
// cpu-µs/probe is the CPU time of the whole process (prober, proxies, echo
// endpoint, NATS) per probe: on a shared machine it is steadier than
// probes/s, which depends on the CPU left by others.
func BenchmarkProbes(b *testing.B) {
	env := newBenchEnv(b)
	var baseline float64
	b.Run("baseline", func(b *testing.B) {
		baseline = env.bareLoop(b)
	})
	b.Run("scheduled", func(b *testing.B) {
		// Measured after a quarter of the fleet was probed: the view's
		// initial values, which take far less, are in by then and the
		// prober runs as it would for hours.
		m := env.runProber(b, probe.Config{Interval: time.Nanosecond, Concurrency: benchConcurrency}, benchFleet/4, 0)
		b.ReportMetric(m.rate, "probes/s")
		if baseline > 0 {
			b.ReportMetric(m.rate/baseline, "x-baseline")
		}
	})
	b.Run("fleet-15s", func(b *testing.B) {
		m := env.runProber(b, probe.Config{Interval: 15 * time.Second}, 1, 2*benchFleet)
		b.ReportMetric(m.rate, "probes/s")
		b.ReportMetric(m.p99, "p99-late-ms")
		b.ReportMetric(m.max, "max-late-ms")
	})
}

// BenchmarkProbeReplicas splits the 10,000 proxies between health replicas
// (in one process, so on the same two cores), each probing its share with
// 32 probes in flight and every proxy always due, as in
// BenchmarkProbes/scheduled:
//
//   - baseline: one replica, a member of fleet-health alone.
//   - two: two replicas, measured once both see each other. x-one-replica
//     is its probes/s as a multiple of the baseline's; min-share is the
//     share of the probes the less busy replica ran (0.5 is an even split).
//
// On one host the two replicas share the CPU the probes need, so
// x-one-replica says what the split costs (about 1 is nothing); on two hosts
// each replica brings its own cores.
func BenchmarkProbeReplicas(b *testing.B) {
	env := newBenchEnv(b)
	cfg := func(id string) probe.Config {
		return probe.Config{Interval: time.Nanosecond, Concurrency: benchConcurrency, Replica: id}
	}
	var one float64
	b.Run("baseline", func(b *testing.B) {
		m := env.runProbers(b, []probe.Config{cfg("bench-1")}, benchFleet/4, 0)
		one = m.rate
		b.ReportMetric(m.rate, "probes/s")
	})
	b.Run("two", func(b *testing.B) {
		m := env.runProbers(b, []probe.Config{cfg("bench-1"), cfg("bench-2")}, benchFleet/4, 0)
		b.ReportMetric(m.rate, "probes/s")
		b.ReportMetric(m.minShare, "min-share")
		if one > 0 {
			b.ReportMetric(m.rate/one, "x-one-replica")
		}
	})
}

type benchEnv struct {
	conn    *bus.Conn
	echoURL *url.URL
	addrs   []string
}

func newBenchEnv(b *testing.B) *benchEnv {
	b.Helper()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	// A listener per proxy, and per probe in flight a connection to the
	// proxy and one from it to the echo endpoint, each with two ends.
	if need := uint64(benchFleet + 4*1024 + 1000); lim.Cur < need {
		b.Fatalf("open files limit %d: the benchmark needs %d (raise ulimit -n)", lim.Cur, need)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Goroutines inherit the profiler labels of the one starting them: a
	// CPU profile (-cpuprofile, then pprof -tags) splits by role.
	var c *bus.Conn
	pprof.Do(ctx, pprof.Labels("role", "nats"), func(context.Context) { c = bustest.Start(b) })
	echoSrv := httptest.NewUnstartedServer(echo.Handler())
	pprof.Do(ctx, pprof.Labels("role", "echo"), func(context.Context) { echoSrv.Start() })
	b.Cleanup(echoSrv.Close)
	u, _ := url.Parse(echoSrv.URL + "/")
	env := &benchEnv{conn: c, echoURL: u}

	per := benchFleet / benchGroups
	pprof.Do(ctx, pprof.Labels("role", "proxies"), func(context.Context) {
		for g := range benchGroups {
			f := newProxyFarm(b, fmt.Sprintf("127.0.0.%d", g+1), per)
			env.addrs = append(env.addrs, f.addrs...)
		}
	})

	pools, err := c.JS.KeyValue(ctx, bus.BucketPools)
	if err != nil {
		b.Fatal(err)
	}
	pool, _ := json.Marshal(projection.Pool{Name: "bench", Provider: "local", Size: benchFleet,
		Spec: events.PoolSpec{Name: "bench", Provider: "local", Size: benchFleet}, Revision: 1})
	if _, err := pools.Put(ctx, "bench", pool); err != nil {
		b.Fatal(err)
	}
	proxies, err := c.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		b.Fatal(err)
	}
	acks := make([]jetstream.PubAckFuture, 0, len(env.addrs))
	for i, addr := range env.addrs {
		id := fmt.Sprintf("bench-%05d", i)
		v, _ := json.Marshal(projection.Proxy{ID: id, Pool: "bench", Entry: "local", Target: "t1",
			State: events.ProxyReady, Address: addr, Attempt: 1, Revision: 1, Seq: 1})
		ack, err := c.JS.PublishAsync("$KV."+bus.BucketProxies+"."+id, v)
		if err != nil {
			b.Fatal(err)
		}
		acks = append(acks, ack)
	}
	for _, a := range acks {
		select {
		case <-a.Ok():
		case err := <-a.Err():
			b.Fatalf("fleet-proxies put: %v", err)
		case <-ctx.Done():
			b.Fatal("fleet-proxies puts not acknowledged")
		}
	}
	if st, err := proxies.Status(ctx); err != nil || st.Values() != benchFleet {
		b.Fatalf("fleet-proxies holds %v values (%v), want %d", st, err, benchFleet)
	}
	return env
}

// bareLoop runs the checks of b.N probes, benchConcurrency at a time, and
// returns the probes per second.
func (env *benchEnv) bareLoop(b *testing.B) float64 {
	ctx := context.Background()
	var next, failed atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	cpu := cpuTime(b)
	b.ResetTimer()
	for range benchConcurrency {
		wg.Add(1)
		go pprof.Do(ctx, pprof.Labels("role", "prober"), func(ctx context.Context) {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(b.N) {
					return
				}
				res := probe.Check(ctx, env.addrs[i%int64(len(env.addrs))], nil, env.echoURL, 3*time.Second)
				if !res.OK() {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, res.Err().Error())
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64((cpuTime(b)-cpu).Microseconds())/float64(b.N), "cpu-µs/probe")
	if n := failed.Load(); n > 0 {
		b.Fatalf("%d of %d probes failed, the first with %v", n, b.N, firstErr.Load())
	}
	rate := float64(b.N) / b.Elapsed().Seconds()
	b.ReportMetric(rate, "probes/s")
	return rate
}

type proberFigures struct {
	rate     float64 // probes per second
	p99, max float64 // lateness of the first prober, ms
	minShare float64 // the share of the probes of the least busy prober
}

// runProber runs a prober over the fleet, waits for warmUp probes, then
// measures until it has probed max(b.N, atLeast) times more, and reads its
// metrics.
func (env *benchEnv) runProber(b *testing.B, cfg probe.Config, warmUp, atLeast int) proberFigures {
	return env.runProbers(b, []probe.Config{cfg}, warmUp, atLeast)
}

// runProbers is runProber for several probers side by side (health
// replicas), counting the probes of all: it starts measuring once each
// replica sees them all.
func (env *benchEnv) runProbers(b *testing.B, cfgs []probe.Config, warmUp, atLeast int) proberFigures {
	b.StopTimer()
	readers := make([]*metric.ManualReader, len(cfgs))
	probers := make([]*probe.Prober, len(cfgs))
	for i, cfg := range cfgs {
		readers[i] = metric.NewManualReader()
		mp := metric.NewMeterProvider(metric.WithReader(readers[i]), metric.WithView(metric.NewView(
			metric.Instrument{Name: "proxyfleet_health_probe_lateness_seconds"},
			metric.Stream{Aggregation: metric.AggregationBase2ExponentialHistogram{MaxSize: 320, MaxScale: 20}},
		)))
		defer func() { _ = mp.Shutdown(context.Background()) }()
		tel := &telemetry.Telemetry{Tracer: tracenoop.NewTracerProvider().Tracer(""), Meter: mp.Meter("bench")}
		cfg.EchoURL = env.echoURL.String()
		pr, err := probe.New(env.conn, cfg, nil, tel)
		if err != nil {
			b.Fatal(err)
		}
		probers[i] = pr
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go pprof.Do(ctx, pprof.Labels("role", "prober"), func(ctx context.Context) { done <- pr.Run(ctx) })
		defer func() {
			cancel()
			if err := <-done; err != nil {
				b.Errorf("prober: %v", err)
			}
		}()
	}
	if len(probers) > 1 {
		deadline := time.Now().Add(time.Minute)
		for _, pr := range probers {
			for len(pr.Members()) != len(probers) {
				if time.Now().After(deadline) {
					b.Fatalf("replicas see members %v after a minute, want %d", pr.Members(), len(probers))
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	collectAll := func() (metricsNow, []int) {
		var sum metricsNow
		each := make([]int, len(readers))
		for i, r := range readers {
			m := collect(b, r)
			each[i] = m.probes
			sum.probes += m.probes
			sum.failed += m.failed
			if i == 0 {
				sum.lateness = m.lateness
			}
		}
		return sum, each
	}

	want := max(b.N, atLeast)
	var each []int
	wait := func(n int) metricsNow {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		deadline := time.After(5 * time.Minute)
		for {
			var m metricsNow
			m, each = collectAll()
			if m.probes >= n {
				return m
			}
			select {
			case <-tick.C:
			case <-deadline:
				b.Fatalf("%d probes after 5 minutes, want %d", m.probes, n)
			}
		}
	}
	start := wait(warmUp)
	first := slices.Clone(each)
	var mem0, mem1 runtime.MemStats
	runtime.ReadMemStats(&mem0)
	begin, cpu := time.Now(), cpuTime(b)
	b.StartTimer()
	end := wait(start.probes + want)
	b.StopTimer()
	elapsed, cpu := time.Since(begin), cpuTime(b)-cpu
	runtime.ReadMemStats(&mem1)
	if end.failed > 0 {
		b.Fatalf("%d of %d probes failed; %s", end.failed, end.probes, env.failedRecord(b))
	}
	n := end.probes - start.probes
	b.ReportMetric(float64(elapsed.Nanoseconds())/float64(n), "ns/op")
	b.ReportMetric(float64(cpu.Microseconds())/float64(n), "cpu-µs/probe")
	// More probes than b.N may have run: the framework's figures would
	// divide by b.N.
	b.ReportMetric(float64(mem1.TotalAlloc-mem0.TotalAlloc)/float64(n), "B/op")
	b.ReportMetric(float64(mem1.Mallocs-mem0.Mallocs)/float64(n), "allocs/op")
	mx, _ := end.lateness.Max.Value()
	share := 1.0
	for i := range each {
		share = min(share, float64(each[i]-first[i])/float64(n))
	}
	// The instrument is in seconds; the figures are in ms.
	return proberFigures{rate: float64(n) / elapsed.Seconds(), p99: 1000 * end.lateness.quantile(0.99), max: 1000 * mx, minShare: share}
}

// cpuTime is the CPU time the process has used: the prober, the proxies,
// the echo endpoint and NATS all run in it. On a shared machine it says
// what a probe costs where probes/s says how much CPU was left.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// failedRecord describes a probe record of a failed probe, if any is left.
func (env *benchEnv) failedRecord(b *testing.B) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kv, err := env.conn.JS.KeyValue(ctx, bus.BucketProbes)
	if err != nil {
		return err.Error()
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return err.Error()
	}
	found := "no failed record left"
	for e := range w.Updates() {
		if e == nil {
			break
		}
		var r probe.Record
		if json.Unmarshal(e.Value(), &r) == nil && !r.OK {
			found = fmt.Sprintf("%s at %s: %s", r.ID, r.Address, r.LastError)
			break
		}
	}
	_ = w.Stop()
	for range w.Updates() {
	}
	return found
}

type metricsNow struct {
	probes, failed int
	lateness       expHist
}

func collect(b *testing.B, r *metric.ManualReader) metricsNow {
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		b.Fatal(err)
	}
	var m metricsNow
	for _, sm := range rm.ScopeMetrics {
		for _, x := range sm.Metrics {
			switch d := x.Data.(type) {
			case metricdata.Sum[int64]:
				if x.Name != "proxyfleet_health_probes_total" {
					continue
				}
				for _, p := range d.DataPoints {
					m.probes += int(p.Value)
					if v, _ := p.Attributes.Value("outcome"); v.AsString() != "ok" {
						m.failed += int(p.Value)
					}
				}
			case metricdata.ExponentialHistogram[float64]:
				if x.Name == "proxyfleet_health_probe_lateness_seconds" && len(d.DataPoints) == 1 {
					m.lateness = expHist(d.DataPoints[0])
				}
			}
		}
	}
	return m
}

type expHist metricdata.ExponentialHistogramDataPoint[float64]

// quantile returns the upper bound of the bucket holding quantile q: an
// overestimate by at most the bucket's width.
func (h expHist) quantile(q float64) float64 {
	rank := uint64(math.Ceil(q * float64(h.Count)))
	seen := h.ZeroCount
	if seen >= rank {
		return 0
	}
	base := math.Exp2(math.Exp2(-float64(h.Scale)))
	for i, n := range h.PositiveBucket.Counts {
		seen += n
		if seen >= rank {
			return math.Pow(base, float64(h.PositiveBucket.Offset)+float64(i)+1)
		}
	}
	mx, _ := h.Max.Value()
	return mx
}

// proxyFarm is a forward proxy (plain HTTP with absolute URLs, and CONNECT)
// listening on many loopback ports, egressing from one source address. It
// keeps connections to the origin alive across plain requests, as real
// forward proxies do.
type proxyFarm struct {
	source string
	addrs  []string
	out    *http.Transport
	dialer *net.Dialer
	srv    *http.Server
	wg     sync.WaitGroup // serving loops and tunnels, which the server does not track
}

func newProxyFarm(b *testing.B, source string, n int) *proxyFarm {
	b.Helper()
	f := &proxyFarm{source: source, dialer: &net.Dialer{
		Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(source)}, Control: bindNoPort,
	}}
	f.out = &http.Transport{DialContext: f.dialer.DialContext, MaxIdleConnsPerHost: 64}
	f.srv = &http.Server{Handler: f, ReadHeaderTimeout: 5 * time.Second}
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatalf("proxy listener: %v", err)
		}
		f.addrs = append(f.addrs, ln.Addr().String())
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			_ = f.srv.Serve(ln)
		}()
	}
	b.Cleanup(func() {
		_ = f.srv.Close()
		f.wg.Wait()
		f.out.CloseIdleConnections()
	})
	return f
}

var hopByHop = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func (f *proxyFarm) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect {
		f.tunnel(w, r)
		return
	}
	if !r.URL.IsAbs() {
		http.Error(w, "absolute URL required", http.StatusBadRequest)
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI, out.Close = "", false
	for _, h := range hopByHop {
		out.Header.Del(h)
	}
	resp, err := f.out.RoundTrip(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	relay(w, resp)
}

func (f *proxyFarm) tunnel(w http.ResponseWriter, r *http.Request) {
	f.wg.Add(1)
	defer f.wg.Done()
	up, err := f.dialer.DialContext(r.Context(), "tcp", r.Host)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer up.Close()
	down, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer down.Close()
	if _, err := io.WriteString(down, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(up, down)
		_ = up.Close()
	}()
	_, _ = io.Copy(down, up)
	_ = down.Close()
	<-done
}
