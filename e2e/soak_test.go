//go:build soak

package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
)

// The long run (make soak SOAK=30m; its 3-minute run is make test-soak,
// docs/soak.md): the services as processes on one JetStream server, a
// pool scaled up and down, proxies recycled and killed with kill -9,
// health and a planner restarted, and a client sending requests through
// the gateway at a steady rate, while every service's RSS, goroutines and
// open files and every stream's and bucket's size are sampled. It fails
// when a figure grows beyond the bounds of soakBounds, when a request
// fails beyond its retries outside a fault's window, when a service logs
// an error no injected fault explains, or when a service dies unasked.
//
// Knobs (environment): PROXYFLEET_SOAK the run's length (required: the
// test is skipped without it), PROXYFLEET_SOAK_SAMPLE the sampling period
// (30s), PROXYFLEET_SOAK_STEP the period of the churn's steps (15s),
// PROXYFLEET_SOAK_RATE client requests per second (5),
// PROXYFLEET_SOAK_OUT the directory the samples are written to
// (soak.json, soak.csv; a temporary one by default).

// soakServices are the processes sampled, by log name.
var soakServices = []string{"planner-1", "planner-2", "health", "local-agent", "gateway"}

// soakSample is one sampling of the system.
type soakSample struct {
	T        float64               `json:"t"` // seconds since the start
	Services map[string]soakProc   `json:"services"`
	Streams  map[string]soakStream `json:"streams"` // streams, KV_<bucket> and OBJ_<store>
	Proxies  int                   `json:"proxies"` // proxy processes running
	Traffic  soakTrafficCounts     `json:"traffic"`
}

// soakProc is one service process's figures; -1 when unread.
type soakProc struct {
	PID        int   `json:"pid"`
	RSS        int64 `json:"rss_bytes"`
	Goroutines int64 `json:"goroutines"`
	FDs        int64 `json:"open_fds"`
}

type soakStream struct {
	Msgs  uint64 `json:"msgs"`
	Bytes uint64 `json:"bytes"`
}

type soakTrafficCounts struct {
	Sent    int64 `json:"sent"`
	Retried int64 `json:"retried"` // requests that needed more than one attempt
	Failed  int64 `json:"failed"`  // requests that failed every attempt
}

// soakFault is one injected fault or churn step.
type soakFault struct {
	T       float64 `json:"t"`
	Kind    string  `json:"kind"` // scale, recycle, kill-proxy, restart-health, restart-planner
	What    string  `json:"what"`
	Service string  `json:"service,omitempty"` // the service restarted
}

// soakRun is what the run writes to soak.json.
type soakRun struct {
	Duration string       `json:"duration"`
	Sample   string       `json:"sample"`
	Step     string       `json:"step"`
	Rate     float64      `json:"rate"`
	Samples  []soakSample `json:"samples"`
	Faults   []soakFault  `json:"faults"`
	Errors   []string     `json:"unexplained_errors"`
}

func soakEnvDuration(t *testing.T, name string, def time.Duration) time.Duration {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("%s=%q: want a positive duration such as 30s or 30m", name, v)
	}
	return d
}

// soakFleet is the fleet of the long run.
type soakFleet struct {
	*fleet
	echo    string // ip:port of the probes' echo endpoint, outside health
	mmu     sync.Mutex
	metrics map[string]string
	starts  map[string]int // metrics lines of each service's log before its last start
	planner int            // the planner restarted next (1 or 2)
}

func (s *soakFleet) startService(name string) {
	s.t.Helper()
	s.mmu.Lock()
	s.starts[name] = len(metricsServing.FindAllString(s.log(name), -1))
	delete(s.metrics, name)
	s.mmu.Unlock()
	bin := name
	var args []string
	switch name {
	case "planner-1", "planner-2":
		bin = "planner"
		args = []string{"--id", name, "--reconcile-interval", "300ms"}
	case "health":
		args = []string{"--echo-addr", "", "--echo-url", "http://" + s.echo + "/", "--probe-interval", "500ms", "--probe-timeout", "3s"}
	case "local-agent":
		args = append([]string{"--entry", "local", "--target", "t1", "--state-dir", s.stateDir, "--ports", "0", "--capacity", "40",
			"--egress-allow", s.echo}, s.agentArg...)
	case "gateway":
		args = []string{"--listen", "127.0.0.1:0", "--demand-interval", "1s"}
	}
	s.startBinary(name, filepath.Join(binDir, bin), nil, append([]string{"--log-level", "info", "--metrics-addr", "127.0.0.1:0"}, args...)...)
}

// metricsAddr is the metrics endpoint of the service's latest start, or ""
// while it has not logged it yet.
func (s *soakFleet) metricsAddr(name string) string {
	s.mmu.Lock()
	defer s.mmu.Unlock()
	if a := s.metrics[name]; a != "" {
		return a
	}
	m := metricsServing.FindAllStringSubmatch(s.log(name), -1)
	if len(m) <= s.starts[name] {
		return ""
	}
	s.metrics[name] = m[len(m)-1][1]
	return s.metrics[name]
}

func (s *soakFleet) pid(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c := s.procs[name]; c != nil && c.Process != nil {
		return c.Process.Pid
	}
	return 0
}

// sampleProc reads a service's RSS and open files from /proc and its
// goroutines from its metrics endpoint.
func (s *soakFleet) sampleProc(name string) soakProc {
	p := soakProc{PID: s.pid(name), RSS: -1, Goroutines: -1, FDs: -1}
	if p.PID == 0 {
		return p
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.PID)); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				p.RSS = kb << 10
			}
		}
	}
	if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.PID)); err == nil {
		p.FDs = int64(len(ents))
	}
	if addr := s.metricsAddr(name); addr != "" {
		c := http.Client{Timeout: 5 * time.Second}
		if resp, err := c.Get("http://" + addr + "/metrics"); err == nil {
			sc := bufio.NewScanner(resp.Body)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				if v, ok := strings.CutPrefix(sc.Text(), "go_goroutines "); ok {
					f, _ := strconv.ParseFloat(v, 64)
					p.Goroutines = int64(f)
				}
			}
			resp.Body.Close()
		}
	}
	return p
}

func (s *soakFleet) sampleStreams() map[string]soakStream {
	out := map[string]soakStream{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l := s.conn.JS.ListStreams(ctx)
	for info := range l.Info() {
		out[info.Config.Name] = soakStream{Msgs: info.State.Msgs, Bytes: info.State.Bytes}
	}
	if err := l.Err(); err != nil {
		s.t.Logf("soak: listing the streams: %v", err)
	}
	return out
}

// soakClient sends requests through the gateway at a steady rate; a
// request is tried up to three times, as a crawler retries.
type soakClient struct {
	c                     *http.Client
	target                string
	sent, retried, failed atomic.Int64
	mu                    sync.Mutex
	failures              []soakFailure
}

type soakFailure struct {
	at  time.Time
	err string
}

func (c *soakClient) once() error {
	resp, err := c.c.Get(c.target)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || string(b) != "ok" || resp.Header.Get("X-Proxyfleet-Proxy") == "" {
		return fmt.Errorf("status %d, proxy %q, body %.80q", resp.StatusCode, resp.Header.Get("X-Proxyfleet-Proxy"), b)
	}
	return nil
}

func (c *soakClient) request() {
	c.sent.Add(1)
	var err error
	for attempt := range 3 {
		if attempt > 0 {
			if attempt == 1 {
				c.retried.Add(1)
			}
			time.Sleep(time.Duration(attempt) * 500 * time.Millisecond)
		}
		if err = c.once(); err == nil {
			return
		}
	}
	c.failed.Add(1)
	c.mu.Lock()
	c.failures = append(c.failures, soakFailure{at: time.Now(), err: err.Error()})
	c.mu.Unlock()
}

// run sends rate requests a second, each in its own goroutine so that a
// slow one does not slow the rate, until ctx ends.
func (c *soakClient) run(ctx context.Context, rate float64, wg *sync.WaitGroup) {
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			wg.Add(1)
			go func() { defer wg.Done(); c.request() }()
		}
	}
}

func TestSoak(t *testing.T) {
	total := soakEnvDuration(t, "PROXYFLEET_SOAK", 0)
	testgate.Need(t, total > 0, "PROXYFLEET_SOAK is not set: make soak SOAK=30m (or make test-soak, 3 minutes) runs the long run")
	every := soakEnvDuration(t, "PROXYFLEET_SOAK_SAMPLE", 30*time.Second)
	stepEvery := soakEnvDuration(t, "PROXYFLEET_SOAK_STEP", 15*time.Second)
	rate := 5.0
	if v := os.Getenv("PROXYFLEET_SOAK_RATE"); v != "" {
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || r <= 0 || r > 200 {
			t.Fatalf("PROXYFLEET_SOAK_RATE=%q: want requests per second, above 0 and at most 200", v)
		}
		rate = r
	}
	if total < 4*every {
		t.Fatalf("PROXYFLEET_SOAK=%s is shorter than 4 samples of PROXYFLEET_SOAK_SAMPLE=%s: the bounds compare the run's halves", total, every)
	}
	out := os.Getenv("PROXYFLEET_SOAK_OUT")
	if out == "" {
		out = t.TempDir()
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}

	f := newFleet(t)
	s := &soakFleet{fleet: f, metrics: map[string]string{}, starts: map[string]int{}, planner: 2}
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := strings.Cut(r.RemoteAddr, ":")
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{"ip": host})
	}))
	t.Cleanup(echo.Close)
	s.echo = echo.Listener.Addr().String()
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(site.Close)
	f.allow(site)
	t.Cleanup(func() {
		for _, pid := range f.proxyProcs() {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, n := range soakServices {
			l := f.log(n)
			if len(l) > 4000 {
				l = l[len(l)-4000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})

	for _, n := range soakServices[:4] {
		s.startService(n)
	}
	f.waitAgent("local", "t1")
	f.waitLeader()
	s.startService("gateway")
	var gw string
	waitFor(t, 60*time.Second, "the gateway to serve", func() bool {
		m := gatewayServing.FindStringSubmatch(f.log("gateway"))
		if m != nil {
			gw = m[1]
		}
		return m != nil
	})
	const pool = "soak"
	f.apply(events.PoolSpec{Name: pool, Provider: "local", Size: 3})
	f.waitPool(pool, 3, "ready", 120*time.Second)
	client := &soakClient{target: site.URL + "/page", c: &http.Client{Timeout: 15 * time.Second, Transport: &http.Transport{
		Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: gw, User: url.UserPassword(pool, "x")}),
	}}}
	waitFor(t, 60*time.Second, "the gateway to route to the pool", func() bool { return client.once() == nil })

	run := soakRun{Duration: total.String(), Sample: every.String(), Step: stepEvery.String(), Rate: rate}
	t0 := time.Now()
	since := func() float64 { return math.Round(time.Since(t0).Seconds()*10) / 10 }
	var faultMu sync.Mutex
	fault := func(kind, what, service string) {
		faultMu.Lock()
		run.Faults = append(run.Faults, soakFault{T: since(), Kind: kind, What: what, Service: service})
		faultMu.Unlock()
		t.Logf("soak %6.1fs: %s: %s", since(), kind, what)
	}

	ctx, cancel := context.WithTimeout(context.Background(), total)
	defer cancel()
	var reqs sync.WaitGroup
	clientDone := make(chan struct{})
	go func() { defer close(clientDone); client.run(ctx, rate, &reqs) }()

	// The churn: one step every stepEvery, the same cycle over and over,
	// so that both halves of the run see the same mix.
	churnDone := make(chan struct{})
	go func() {
		defer close(churnDone)
		steps := soakSteps(s, pool, fault)
		tick := time.NewTicker(stepEvery)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			steps[i%len(steps)]()
		}
	}()

	sample := func() {
		smp := soakSample{T: since(), Services: map[string]soakProc{}}
		for _, n := range soakServices {
			smp.Services[n] = s.sampleProc(n)
		}
		smp.Streams = s.sampleStreams()
		smp.Proxies = len(f.proxyProcs())
		smp.Traffic = soakTrafficCounts{Sent: client.sent.Load(), Retried: client.retried.Load(), Failed: client.failed.Load()}
		run.Samples = append(run.Samples, smp)
	}
	sample()
	tick := time.NewTicker(every)
sampling:
	for {
		select {
		case <-ctx.Done():
			break sampling
		case <-tick.C:
			sample()
		}
	}
	tick.Stop()
	<-churnDone
	<-clientDone // no request starts any more: reqs.Wait may not race an Add
	reqs.Wait()
	elapsed := time.Since(t0)

	// The fleet settles to the pool's size: no proxy process left over.
	f.apply(events.PoolSpec{Name: pool, Provider: "local", Size: 3})
	f.waitPool(pool, 3, "ready", 180*time.Second)
	waitFor(t, 120*time.Second, "exactly 3 proxy processes (none leaked)", func() bool { return len(f.proxyProcs()) == 3 })
	if err := client.once(); err != nil {
		t.Errorf("the gateway does not serve after the run: %v", err)
	}
	for _, n := range soakServices {
		if pid := s.pid(n); pid == 0 || isZombie(pid) {
			t.Errorf("%s (pid %d) is no longer running: it died during the run without being asked to", n, pid)
		}
	}

	// Errors no fault explains: failed requests and error log lines.
	windows := soakWindows(t0, run.Faults)
	client.mu.Lock()
	explained := 0
	for _, fl := range client.failures {
		if w := windows.covering(fl.at); w != "" {
			explained++
			continue
		}
		run.Errors = append(run.Errors, fmt.Sprintf("client %s: request failed after 3 attempts outside any fault's window: %s", fl.at.Format(time.RFC3339Nano), fl.err))
	}
	client.mu.Unlock()
	errLines, warnLines := 0, map[string]int{}
	for _, n := range soakServices {
		log := f.log(n)
		warnLines[n] = strings.Count(log, `"level":"WARN"`)
		for _, e := range soakErrorLines(log) {
			errLines++
			if windows.explains(n, e) {
				continue
			}
			run.Errors = append(run.Errors, fmt.Sprintf("%s: error no injected fault explains: %s", n, e.raw))
		}
	}
	t.Logf("soak: warning lines by service (reported, not failed): %v", warnLines)
	sent, failed := client.sent.Load(), client.failed.Load()
	t.Logf("soak: %s, %d samples every %s, %d churn steps, %d requests at %.1f/s (%d retried, %d failed: %d within a fault's window), %d error log lines (%d unexplained)",
		elapsed.Round(time.Second), len(run.Samples), every, len(run.Faults), sent, rate, client.retried.Load(), failed, explained, errLines, len(run.Errors))
	covered := 0
	for d := time.Duration(0); d < elapsed; d += 100 * time.Millisecond {
		if windows.covering(t0.Add(d)) != "" {
			covered++
		}
	}
	t.Logf("soak: the windows of killed and recycled proxies cover %.0f%% of the run", 100*float64(covered)/math.Max(1, elapsed.Seconds()*10))
	if failed*100 > sent {
		t.Errorf("%d of %d requests failed after 3 attempts: more than 1%% (first: %v)", failed, sent, client.failures[0].err)
	}
	if want := int64(elapsed.Seconds() * rate * 0.8); sent < want {
		t.Errorf("only %d requests were sent in %s at %.1f/s (want at least %d): the client did not keep its rate", sent, elapsed.Round(time.Second), rate, want)
	}
	for i, e := range run.Errors {
		if i == 20 {
			t.Errorf("... and %d more", len(run.Errors)-20)
			break
		}
		t.Error(e)
	}

	// The bounds.
	bad, report := soakCheck(run.Samples)
	fmt.Println(strings.Join(report, "\n"))
	for _, v := range bad {
		t.Error(v)
	}
	soakWrite(t, out, &run)
}

// soakSteps is the churn's cycle: scale, kill -9 and recycle proxies,
// restart health and a planner.
func soakSteps(s *soakFleet, pool string, fault func(kind, what, service string)) []func() {
	t := s.t
	scale := func(n int) func() {
		return func() {
			if _, err := s.api.PoolApply(context.Background(), events.PoolSpec{Name: pool, Provider: "local", Size: n}); err != nil {
				// A planner restarting may leave the API without an
				// answer for a moment: the client retries.
				time.Sleep(2 * time.Second)
				if _, err = s.api.PoolApply(context.Background(), events.PoolSpec{Name: pool, Provider: "local", Size: n}); err != nil {
					t.Errorf("scale %s to %d: %v", pool, n, err)
					return
				}
			}
			fault("scale", fmt.Sprintf("pool %s to %d", pool, n), "")
		}
	}
	ready := func() *proxyView {
		ps, err := s.readViews("fleet-proxies")
		if err != nil {
			return nil
		}
		var ids []string
		for _, raw := range ps {
			var v proxyView
			if json.Unmarshal(raw, &v) == nil && v.Pool == pool && v.State == "ready" {
				ids = append(ids, string(raw))
			}
		}
		if len(ids) == 0 {
			return nil
		}
		sort.Strings(ids)
		var v proxyView
		_ = json.Unmarshal([]byte(ids[len(ids)/2]), &v)
		return &v
	}
	kill := func() {
		p := ready()
		if p == nil {
			t.Logf("soak: no ready proxy to kill this step")
			return
		}
		b, err := os.ReadFile(filepath.Join(s.stateDir, events.InstanceName(p.ID)+".json"))
		var st struct {
			PID int `json:"pid"`
		}
		if err != nil || json.Unmarshal(b, &st) != nil || st.PID <= 0 {
			t.Logf("soak: proxy %s has no process to kill yet", p.ID)
			return
		}
		fault("kill-proxy", fmt.Sprintf("kill -9 proxy %s (pid %d)", p.ID, st.PID), "")
		_ = syscall.Kill(st.PID, syscall.SIGKILL)
	}
	recycle := func() {
		p := ready()
		if p == nil {
			t.Logf("soak: no ready proxy to recycle this step")
			return
		}
		fault("recycle", "recycle proxy "+p.ID, "")
		if _, err := s.api.Recycle(context.Background(), api.ProxyRecycleRequest{ID: p.ID, Now: true}); err != nil {
			t.Logf("soak: recycle %s: %v (the proxy may have gone meanwhile)", p.ID, err)
		}
	}
	restart := func(name, kind string) {
		fault(kind, "restart "+name, name)
		s.stop(name)
		s.startService(name)
	}
	restartHealth := func() { restart("health", "restart-health") }
	restartPlanner := func() {
		restart(fmt.Sprintf("planner-%d", s.planner), "restart-planner")
		s.planner = 3 - s.planner
	}
	return []func(){scale(5), kill, recycle, restartHealth, scale(2), restartPlanner, scale(3), kill}
}

// soakErrorLine is one error-level line of a service's log.
type soakErrorLine struct {
	at  time.Time
	msg string
	raw string
}

func soakErrorLines(log string) []soakErrorLine {
	var out []soakErrorLine
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, `"level":"ERROR"`) {
			continue
		}
		var v struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		_ = json.Unmarshal([]byte(line), &v)
		out = append(out, soakErrorLine{at: v.Time, msg: v.Msg, raw: line})
	}
	return out
}

// How long after a fault its effects are expected. A request through a
// proxy killed or recycled may fail until health has found it down and
// the gateway routes around it (probes every 500 ms, a few failures in a
// row): soakRequestWindow. A restarted service may log errors while it
// stops and starts: soakRestartWindow. Restarting health or a planner
// explains no failed request: the gateway routes from the views, which
// stay.
const (
	soakRequestWindow = 15 * time.Second
	soakRestartWindow = 30 * time.Second
)

// soakWindow is a fault's window: from a second before it to its
// window's length after it.
type soakWindow struct {
	from, to time.Time
	kind     string
	service  string // the service restarted, or ""
}

type soakWindowList []soakWindow

func soakWindows(t0 time.Time, faults []soakFault) soakWindowList {
	var out soakWindowList
	for _, f := range faults {
		if f.Kind == "scale" {
			continue // a scale is no fault: nothing may fail because of it
		}
		at := t0.Add(time.Duration(f.T * float64(time.Second)))
		d := soakRequestWindow
		if f.Service != "" {
			d = soakRestartWindow
		}
		out = append(out, soakWindow{from: at.Add(-time.Second), to: at.Add(d), kind: f.Kind, service: f.Service})
	}
	return out
}

// covering names a proxy killed or recycled whose window holds at, or
// "": a request failing then (every attempt) is put down to it.
func (w soakWindowList) covering(at time.Time) string {
	for _, x := range w {
		if x.service == "" && !at.Before(x.from) && !at.After(x.to) {
			return x.kind
		}
	}
	return ""
}

// explains reports whether an error line of service is put down to an
// injected fault: only a restart of that very service explains its own
// error lines in the restart's window (its stop and its start). A proxy
// killed or recycled explains no error line (health reports a proxy down
// as a warning, and the others' errors would be bugs), nor does a
// restart explain another service's errors: a peer's restart must cost
// retries, not errors.
func (w soakWindowList) explains(service string, e soakErrorLine) bool {
	for _, x := range w {
		if x.service == service && !e.at.Before(x.from) && !e.at.After(x.to) {
			return true
		}
	}
	return false
}

// soakBound bounds one figure: the maximum of the run's second half may
// exceed the first half's by Factor and Slack at most, and never Cap.
type soakBound struct {
	Factor float64
	Slack  float64
	Cap    float64
}

// The bounds of a service's figures (docs/soak.md).
var soakBounds = map[string]soakBound{
	"rss_bytes":  {Factor: 1.5, Slack: 24 << 20, Cap: 256 << 20},
	"goroutines": {Factor: 1.5, Slack: 40, Cap: 2000},
	"open_fds":   {Factor: 1.5, Slack: 20, Cap: 512},
}

// A stream's or bucket's growth in the second half, in messages a second,
// may be at most soakStreamFactor times the first half's and
// soakStreamSlack more (docs/soak.md).
const (
	soakStreamFactor = 2.0
	soakStreamSlack  = 0.2
)

// soakCheck applies the bounds to the samples and returns every figure
// that broke them, and a line for each figure's halves.
func soakCheck(samples []soakSample) (bad, report []string) {
	half := len(samples) / 2
	first, second := samples[:half], samples[half:]
	figures := func(name string, ss []soakSample) map[string]float64 {
		m := map[string]float64{}
		for _, smp := range ss {
			p := smp.Services[name]
			for k, v := range map[string]int64{"rss_bytes": p.RSS, "goroutines": p.Goroutines, "open_fds": p.FDs} {
				if v >= 0 && float64(v) > m[k] {
					m[k] = float64(v)
				}
			}
		}
		return m
	}
	for _, n := range soakServices {
		a, b := figures(n, first), figures(n, second)
		for _, k := range []string{"rss_bytes", "goroutines", "open_fds"} {
			bd := soakBounds[k]
			limit := math.Min(a[k]*bd.Factor+bd.Slack, bd.Cap)
			report = append(report, fmt.Sprintf("soak: %-12s %-10s first half max %12.0f, second half max %12.0f, bound %12.0f", n, k, a[k], b[k], limit))
			if a[k] == 0 || b[k] == 0 {
				bad = append(bad, fmt.Sprintf("%s: %s was never read in one half of the run (first %.0f, second %.0f)", n, k, a[k], b[k]))
				continue
			}
			if b[k] > limit {
				bad = append(bad, fmt.Sprintf("%s: %s grew beyond its bound: second half's maximum %.0f > %.0f (first half's %.0f × %.1f + %.0f, at most %.0f)",
					n, k, b[k], limit, a[k], bd.Factor, bd.Slack, bd.Cap))
			}
		}
	}
	// Streams and buckets: a log grows with the churn, at the rate of the
	// churn; it must not grow faster in the second half than in the
	// first (a loop rewriting, a consumer redelivering), and a bounded
	// stream or bucket must stay near its first half's size.
	names := map[string]bool{}
	for _, smp := range samples {
		for k := range smp.Streams {
			names[k] = true
		}
	}
	sorted := slices.Sorted(func(yield func(string) bool) {
		for k := range names {
			if !yield(k) {
				return
			}
		}
	})
	for _, k := range sorted {
		rate := func(ss []soakSample) (float64, uint64) {
			a, b := ss[0], ss[len(ss)-1]
			var mx uint64
			for _, smp := range ss {
				mx = max(mx, smp.Streams[k].Msgs)
			}
			if b.T <= a.T {
				return 0, mx
			}
			return (float64(b.Streams[k].Msgs) - float64(a.Streams[k].Msgs)) / (b.T - a.T), mx
		}
		r1, m1 := rate(first)
		r2, m2 := rate(second)
		report = append(report, fmt.Sprintf("soak: %-28s msgs/s first half %7.2f, second half %7.2f; max msgs %d, %d; bytes at the end %d",
			k, r1, r2, m1, m2, samples[len(samples)-1].Streams[k].Bytes))
		if r2 > math.Max(r1, 0)*soakStreamFactor+soakStreamSlack {
			bad = append(bad, fmt.Sprintf("stream %s grew faster in the second half (%.2f msgs/s) than %.0f times the first's (%.2f) + %.1f",
				k, r2, soakStreamFactor, r1, soakStreamSlack))
		}
	}
	return bad, report
}

// soakWrite writes the run to out/soak.json and out/soak.csv (one row a
// sample and series: t, series, figure, value).
func soakWrite(t *testing.T, out string, run *soakRun) {
	t.Helper()
	b, err := json.MarshalIndent(run, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, "soak.json"), append(b, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	var csv strings.Builder
	csv.WriteString("t_seconds,series,figure,value\n")
	for _, smp := range run.Samples {
		for _, n := range soakServices {
			p := smp.Services[n]
			fmt.Fprintf(&csv, "%.1f,%s,rss_bytes,%d\n%.1f,%s,goroutines,%d\n%.1f,%s,open_fds,%d\n", smp.T, n, p.RSS, smp.T, n, p.Goroutines, smp.T, n, p.FDs)
		}
		for k, st := range smp.Streams {
			fmt.Fprintf(&csv, "%.1f,%s,msgs,%d\n%.1f,%s,bytes,%d\n", smp.T, k, st.Msgs, smp.T, k, st.Bytes)
		}
		fmt.Fprintf(&csv, "%.1f,proxies,processes,%d\n%.1f,client,sent,%d\n%.1f,client,failed,%d\n", smp.T, smp.Proxies, smp.T, smp.Traffic.Sent, smp.T, smp.Traffic.Failed)
	}
	if err := os.WriteFile(filepath.Join(out, "soak.csv"), []byte(csv.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("soak: samples written to %s (soak.json, soak.csv)", out)
}

// TestSoakBoundsCatchALeak: the bounds pass a steady run's samples and
// fail one whose gateway leaks a goroutine per request (5 a second), one
// whose agent leaks a descriptor per request, and one whose event log
// starts rewriting a key every reconcile (3 messages a second).
func TestSoakBoundsCatchALeak(t *testing.T) {
	steady := func(i int) soakSample {
		smp := soakSample{T: float64(i * 10), Services: map[string]soakProc{}, Streams: map[string]soakStream{}}
		for j, n := range soakServices {
			// Noise: each figure wobbles by a fifth between samples.
			w := int64((i+j)%3) - 1
			smp.Services[n] = soakProc{PID: 100 + j, RSS: (32 + 6*w) << 20, Goroutines: 60 + 12*w, FDs: 16 + 3*w}
		}
		smp.Streams["FLEET_EVENTS"] = soakStream{Msgs: uint64(50 + 7*i)}
		return smp
	}
	run := func(change func(i int, smp *soakSample)) []string {
		var ss []soakSample
		for i := range 18 {
			smp := steady(i)
			change(i, &smp)
			ss = append(ss, smp)
		}
		bad, _ := soakCheck(ss)
		return bad
	}
	if bad := run(func(int, *soakSample) {}); len(bad) != 0 {
		t.Fatalf("a steady run broke the bounds: %v", bad)
	}
	leaks := map[string]func(i int, smp *soakSample){
		"goroutines": func(i int, smp *soakSample) {
			p := smp.Services["gateway"]
			p.Goroutines += int64(i * 10 * 5)
			smp.Services["gateway"] = p
		},
		"open_fds": func(i int, smp *soakSample) {
			p := smp.Services["local-agent"]
			p.FDs += int64(i * 10 * 5)
			smp.Services["local-agent"] = p
		},
		"FLEET_EVENTS": func(i int, smp *soakSample) {
			if i >= 9 {
				smp.Streams["FLEET_EVENTS"] = soakStream{Msgs: smp.Streams["FLEET_EVENTS"].Msgs + uint64((i-8)*10*3)}
			}
		},
	}
	for what, leak := range leaks {
		bad := run(leak)
		if len(bad) != 1 || !strings.Contains(bad[0], what) {
			t.Errorf("a leak of %s: the bounds report %v, want one breach naming %s", what, bad, what)
		}
	}
}
