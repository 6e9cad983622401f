package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// convergeSize is the pool BenchmarkConvergeEndToEnd fills: 10,000 by
// default, PROXYFLEET_BENCH_CONVERGE_SIZE or -args -e2e.converge-size=N
// for a quicker run.
var convergeSize = flag.Int("e2e.converge-size", envInt("PROXYFLEET_BENCH_CONVERGE_SIZE", 10_000),
	"pool size BenchmarkConvergeEndToEnd fills (env PROXYFLEET_BENCH_CONVERGE_SIZE)")

func envInt(key string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(key)); err == nil && n > 0 {
		return n
	}
	return def
}

// convergeTargets are the targets of entry "local" the benchmark's agents
// serve, one agent process each.
var convergeTargets = []string{"t1", "t2", "t3", "t4"}

// convergeMessagesPerProxy is what the ceiling is divided by, as in the
// planner-only BenchmarkConverge (services/planner): the fence and the
// requested decision, the create command, the agent's provisioning and
// running. The health service's ready event and the views' KV writes come
// on top of them, so the ready figure is held to the same ceiling with
// more work to do (the goals say 0.25 for running, 0.15 for
// ready).
const convergeMessagesPerProxy = 5

// BenchmarkConvergeEndToEnd fills a pool of -e2e.converge-size proxies
// (default 10,000) with the whole system running as an operator runs it,
// each service its own process built as make build builds it, on one
// JetStream server embedded in the benchmark's process:
//
//   - the planner, with its defaults;
//   - four agents (entry local, targets t1…t4), each the real agent
//     runtime of pkg/agent over an instant driver (e2e/internal/instantagent):
//     every instance runs at once, at the address of one loopback forward
//     proxy the agent process serves;
//   - health, with its default probing (every proxy through itself, plain
//     HTTP and CONNECT, to its own echo endpoint) and its projection into
//     the KV views.
//
// Sub-benchmarks:
//
//   - baseline: the JetStream ceiling in the same run, measured as the
//     planner-only BenchmarkConverge measures it (convergeMessagesPerProxy
//     small messages per proxy published asynchronously to a file stream
//     with Msg-Ids, 2048 in flight), as proxies/s.
//   - converge: from the pool.apply until every proxy of the pool is
//     running in the log (running-proxies/s) and until every one is ready
//     in fleet-proxies (ready-proxies/s); running-x-ceiling and
//     ready-x-ceiling are each as a fraction of the baseline's proxies/s.
//     ns/op is the time per proxy to ready.
//
// The benchmark's own watchers (an ordered consumer of the running events
// and a watch of fleet-proxies) run in its process beside the server.
//
// With PROXYFLEET_BENCH_PROFILE_DIR=DIR every process writes a CPU profile
// into DIR: planner.pprof, health.pprof and agent-t1.pprof…agent-t4.pprof
// (--cpuprofile: from the end of each one's start-up until it is stopped,
// right after the fill), and nats.pprof, the benchmark's own process (the
// embedded server and the watchers) from the apply to the end of the fill.
// A later round overwrites an earlier one's.
func BenchmarkConvergeEndToEnd(b *testing.B) {
	size := *convergeSize
	bins := convergeBinaries(b)
	var ceiling float64
	b.Run("baseline", func(b *testing.B) {
		ceiling = publishCeiling(b, size)
		b.ReportMetric(ceiling, "proxies/s")
		b.ReportMetric(1e9/ceiling, "ns/op")
		zeroAllocs(b)
	})
	b.Run("converge", func(b *testing.B) {
		var running, ready time.Duration
		for range b.N {
			r := convergeOnce(b, bins, size)
			running += r.running
			ready += r.ready
		}
		n := float64(b.N * size)
		runningRate, readyRate := n/running.Seconds(), n/ready.Seconds()
		b.ReportMetric(1e9/readyRate, "ns/op")
		b.ReportMetric(runningRate, "running-proxies/s")
		b.ReportMetric(readyRate, "ready-proxies/s")
		if ceiling > 0 {
			b.ReportMetric(runningRate/ceiling, "running-x-ceiling")
			b.ReportMetric(readyRate/ceiling, "ready-x-ceiling")
		}
		zeroAllocs(b)
	})
}

// zeroAllocs clears -benchmem's figures, which would count the
// benchmark's own allocations, not the services'.
func zeroAllocs(b *testing.B) {
	b.ReportMetric(0, "B/op")
	b.ReportMetric(0, "allocs/op")
}

// publishCeiling returns the proxies per second JetStream's file store
// takes when each proxy is convergeMessagesPerProxy small messages with
// Msg-Ids published asynchronously, 2048 in flight: the method of the
// planner-only BenchmarkConverge's baseline.
func publishCeiling(b *testing.B, size int) float64 {
	b.Helper()
	c := bustest.Start(b)
	var total time.Duration
	for round := range b.N {
		total += bustest.Ceiling(b, c, round, size*convergeMessagesPerProxy)
	}
	return float64(b.N*size) / total.Seconds()
}

var (
	convergeBuildOnce sync.Once
	convergeBinDir    string
	convergeBuildErr  error
)

// convergeBinaries builds the planner and health as make build does, and
// the instant agent with the same tags, once for the package; or, with
// PROXYFLEET_BENCH_CONVERGE_BINS=DIR, takes planner, health and
// instantagent from DIR, built elsewhere (another commit's, for a
// comparison back to back: docs/performance.md).
func convergeBinaries(b *testing.B) string {
	b.Helper()
	if dir := os.Getenv("PROXYFLEET_BENCH_CONVERGE_BINS"); dir != "" {
		for _, name := range []string{"planner", "health", "instantagent"} {
			if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
				b.Fatalf("PROXYFLEET_BENCH_CONVERGE_BINS: %v", err)
			}
		}
		dir, err := filepath.Abs(dir)
		if err != nil {
			b.Fatal(err)
		}
		return dir
	}
	convergeBuildOnce.Do(func() {
		// Under binDir, which TestMain removes.
		convergeBinDir = filepath.Join(binDir, "converge")
		targets := []string{"--no-print-directory", "-C", "..", "BIN=" + convergeBinDir, "build-planner", "build-health"}
		if out, err := exec.Command("make", targets...).CombinedOutput(); err != nil {
			convergeBuildErr = fmt.Errorf("make %s: %v\n%s", strings.Join(targets, " "), err, out)
			return
		}
		if err := goBuild(filepath.Join(convergeBinDir, "instantagent"), "-tags", serviceTags, "./internal/instantagent"); err != nil {
			convergeBuildErr = fmt.Errorf("build the instant agent: %v", err)
		}
	})
	if convergeBuildErr != nil {
		b.Fatal(convergeBuildErr)
	}
	return convergeBinDir
}

// convergeTimes is one fill: from the apply to the last proxy running in
// the log, and to the last one ready in fleet-proxies.
type convergeTimes struct{ running, ready time.Duration }

// convergeOnce starts a fresh system, fills one pool of size proxies and
// stops it.
func convergeOnce(b *testing.B, bins string, size int) convergeTimes {
	b.Helper()
	dir := b.TempDir()
	c := bustest.StartIn(b, filepath.Join(dir, "nats"))
	profiles := convergeProfiles(b)
	procs := &benchProcs{b: b, dir: dir, url: c.ClientURL(), profiles: profiles}
	defer procs.stopAll()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Agents and health first, so the planner finds the agents when it
	// starts and health projects from the first event.
	for _, target := range convergeTargets {
		procs.start("agent-"+target, filepath.Join(bins, "instantagent"), "--entry", "local", "--target", target)
	}
	procs.start("health", filepath.Join(bins, "health"), "--echo-addr", "127.0.0.1:0")
	agents, err := c.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		b.Fatal(err)
	}
	procs.waitFor("the agents' heartbeats", func() bool {
		for _, target := range convergeTargets {
			if _, err := agents.Get(ctx, agent.HeartbeatKey("local", target)); err != nil {
				return false
			}
		}
		return true
	})
	procs.waitFor("health's projection consumer", func() bool {
		_, err := c.JS.Consumer(ctx, bus.EventsStream, bus.HealthProjection)
		return err == nil
	})
	procs.start("planner", filepath.Join(bins, "planner"))
	store := bus.NewEventStore(c, "e2e", nil)
	client := api.NewClient(c.NC, api.WithTimeout(30*time.Second))
	procs.waitFor("a planner to lead and answer", func() bool {
		if term, err := store.CurrentTerm(ctx); err != nil || term == nil {
			return false
		}
		for _, err := range client.PoolList(ctx, api.PoolListRequest{}) {
			return err == nil
		}
		return true
	})

	requested := watchProxies(b, ctx, c, events.EventSubject(events.AggregateProxy, "*", events.ProxyRequested))
	running := watchProxies(b, ctx, c, events.ObservationFilter("*", events.ProxyRunning))
	projected, ready := watchViews(b, ctx, c)
	if profiles != "" {
		defer profileSelf(b, filepath.Join(profiles, "nats.pprof"))()
	}
	start := time.Now()
	if _, err := client.PoolApply(ctx, events.PoolSpec{Name: "big", Provider: "local", Size: size}); err != nil {
		b.Fatalf("pool.apply: %v", err)
	}
	var t convergeTimes
	timeout := time.After(30 * time.Minute)
	var nRequested, nRunning, nProjected, nReady int
	// The fill's timeline: when half, nine tenths and all of the pool
	// were requested, running and ready, which says what paced it.
	marks := []float64{0.5, 0.9, 1}
	stages := []string{"requested", "running", "projected", "ready"}
	var timeline [4][3]time.Duration
	mark := func(stage, n int) {
		for i, f := range marks {
			if timeline[stage][i] == 0 && float64(n) >= f*float64(size) {
				timeline[stage][i] = time.Since(start)
			}
		}
	}
	for t.running == 0 || t.ready == 0 {
		select {
		case n := <-requested:
			nRequested = n
			mark(0, n)
		case n := <-running:
			nRunning = n
			mark(1, n)
			if n >= size && t.running == 0 {
				t.running = time.Since(start)
			}
		case n := <-projected:
			nProjected = n
			mark(2, n)
		case n := <-ready:
			nReady = n
			mark(3, n)
			if n >= size && t.ready == 0 {
				t.ready = time.Since(start)
			}
		case name := <-procs.exited:
			procs.fail("%s exited during the fill (%d requested, %d running, %d projected running, %d ready of %d)", name, nRequested, nRunning, nProjected, nReady, size)
		case <-timeout:
			procs.fail("after 30m: %d requested, %d running, %d projected running, %d ready of %d", nRequested, nRunning, nProjected, nReady, size)
		}
	}
	b.Logf("%d proxies: running after %v (%.0f/s), ready after %v (%.0f/s)", size,
		t.running.Round(time.Millisecond), float64(size)/t.running.Seconds(), t.ready.Round(time.Millisecond), float64(size)/t.ready.Seconds())
	for i, stage := range stages {
		line := fmt.Sprintf("%-9s", stage)
		for j, f := range marks {
			line += fmt.Sprintf("  %3.0f%% at %6.2fs", 100*f, timeline[i][j].Seconds())
		}
		b.Log(line)
	}
	if nRunning > size {
		b.Errorf("%d proxies ran for a pool of %d: the fill replaced or duplicated some", nRunning, size)
	}
	return t
}

// watchProxies reads the events on subject (a filter whose fourth token
// is the proxy id) in FLEET_EVENTS from the start and sends the number of
// distinct proxies seen, at each new one.
func watchProxies(b *testing.B, ctx context.Context, c *bus.Conn, subject string) <-chan int {
	b.Helper()
	cons, err := c.JS.OrderedConsumer(ctx, bus.EventsStream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subject},
	})
	if err != nil {
		b.Fatal(err)
	}
	out := make(chan int, 1)
	seen := map[string]bool{}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		id := strings.Split(m.Subject(), ".")[3]
		if !seen[id] {
			seen[id] = true
			sendLatest(out, len(seen))
		}
	}, jetstream.PullMaxMessages(1024))
	if err != nil {
		b.Fatal(err)
	}
	context.AfterFunc(ctx, cc.Stop)
	return out
}

// watchViews watches fleet-proxies and sends the number of proxies whose
// view is running or ready (the running events projected), and the number
// whose view is ready, at each change.
func watchViews(b *testing.B, ctx context.Context, c *bus.Conn) (projected, ready <-chan int) {
	b.Helper()
	kv, err := c.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		b.Fatal(err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		b.Fatal(err)
	}
	projectedOut, readyOut := make(chan int, 1), make(chan int, 1)
	go func() {
		defer func() { _ = w.Stop() }()
		up, ready := map[string]bool{}, map[string]bool{}
		// follow keeps set's members those for which in holds, and sends
		// its size on out when it changes.
		follow := func(set map[string]bool, key string, in bool, out chan int) {
			if in == set[key] {
				return
			}
			if in {
				set[key] = true
			} else {
				delete(set, key)
			}
			sendLatest(out, len(set))
		}
		for e := range w.Updates() {
			if e == nil {
				continue // the end of the initial values
			}
			var v struct {
				State string `json:"state"`
			}
			put := e.Operation() == jetstream.KeyValuePut && json.Unmarshal(e.Value(), &v) == nil
			follow(up, e.Key(), put && (v.State == events.ProxyRunning || v.State == events.ProxyReady), projectedOut)
			follow(ready, e.Key(), put && v.State == events.ProxyReady, readyOut)
		}
	}()
	return projectedOut, readyOut
}

// sendLatest replaces what ch holds (capacity 1) with n.
func sendLatest(ch chan int, n int) {
	for {
		select {
		case ch <- n:
			return
		default:
			select {
			case <-ch:
			default:
			}
		}
	}
}

// benchProcs are the service processes of one run, each logging to
// <dir>/<name>.log.
type benchProcs struct {
	b        *testing.B
	dir, url string
	// profiles, when not empty, is where each process writes its CPU
	// profile, <name>.pprof.
	profiles string
	exited   chan string
	mu       sync.Mutex
	procs    map[string]*benchProc
}

type benchProc struct {
	cmd  *exec.Cmd
	done chan struct{}
	stop bool // stopped by the benchmark
}

func (p *benchProcs) start(name, bin string, args ...string) {
	p.b.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.procs == nil {
		p.procs, p.exited = map[string]*benchProc{}, make(chan string, 16)
	}
	args = append([]string{"--nats-url", p.url, "--data-dir", filepath.Join(p.dir, name)}, args...)
	if p.profiles != "" {
		args = append(args, "--cpuprofile", filepath.Join(p.profiles, name+".pprof"))
	}
	cmd := exec.Command(bin, args...)
	logf, err := os.Create(filepath.Join(p.dir, name+".log"))
	if err != nil {
		p.b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		p.b.Fatalf("start %s: %v", name, err)
	}
	proc := &benchProc{cmd: cmd, done: make(chan struct{})}
	p.procs[name] = proc
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(proc.done)
		p.mu.Lock()
		stopped := proc.stop
		p.mu.Unlock()
		if !stopped {
			p.exited <- name
		}
	}()
}

// waitFor polls cond until it holds, failing the benchmark after two
// minutes or when a process exits.
func (p *benchProcs) waitFor(what string, cond func() bool) {
	p.b.Helper()
	deadline := time.After(2 * time.Minute)
	for !cond() {
		select {
		case name := <-p.exited:
			p.fail("%s exited while waiting for %s", name, what)
		case <-deadline:
			p.fail("no %s after 2m", what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// fail ends the benchmark with msg and the last lines of every log.
func (p *benchProcs) fail(format string, args ...any) {
	p.b.Helper()
	p.mu.Lock()
	var names []string
	for name := range p.procs {
		names = append(names, name)
	}
	p.mu.Unlock()
	var logs strings.Builder
	for _, name := range names {
		out, _ := os.ReadFile(filepath.Join(p.dir, name+".log"))
		lines := bytes.Split(bytes.TrimSpace(out), []byte("\n"))
		lines = lines[max(0, len(lines)-15):]
		fmt.Fprintf(&logs, "\n--- %s.log (last %d lines)\n%s", name, len(lines), bytes.Join(lines, []byte("\n")))
	}
	p.b.Fatalf(format+"%s", append(args, logs.String())...)
}

// stopAll ends every process with SIGTERM (each writes the end of its
// profile) and waits for it; one that does not stop in a minute is killed.
func (p *benchProcs) stopAll() {
	p.mu.Lock()
	procs := p.procs
	for _, proc := range procs {
		proc.stop = true
	}
	p.mu.Unlock()
	for _, proc := range procs {
		_ = proc.cmd.Process.Signal(syscall.SIGTERM)
	}
	for name, proc := range procs {
		select {
		case <-proc.done:
		case <-time.After(time.Minute):
			p.b.Errorf("%s did not stop within a minute of SIGTERM; killed", name)
			_ = proc.cmd.Process.Kill()
			<-proc.done
		}
	}
}

// convergeProfiles is PROXYFLEET_BENCH_PROFILE_DIR made absolute and
// created, or "" when it is not set.
func convergeProfiles(b *testing.B) string {
	b.Helper()
	dir := os.Getenv("PROXYFLEET_BENCH_PROFILE_DIR")
	if dir == "" {
		return ""
	}
	dir, err := filepath.Abs(dir)
	if err == nil {
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		b.Fatalf("PROXYFLEET_BENCH_PROFILE_DIR: %v", err)
	}
	return dir
}

// profileSelf writes a CPU profile of the benchmark's process to path
// until the returned stop is called. A profile already running (go test
// -cpuprofile) is left alone and none is written.
func profileSelf(b *testing.B, path string) (stop func()) {
	b.Helper()
	out, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(out); err != nil {
		b.Logf("no profile of the benchmark's process: %v", err)
		_ = out.Close()
		_ = os.Remove(path)
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		if err := out.Close(); err != nil {
			b.Errorf("profile %s: %v", path, err)
		}
	}
}
