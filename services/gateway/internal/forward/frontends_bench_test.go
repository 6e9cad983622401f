package forward_test

import (
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/squidtest"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/forward"
)

// EnvHAProxy names the haproxy binary of the front-end benchmarks
// (default /usr/sbin/haproxy, Debian's); [squidtest.EnvSquid] names squid's
// (default /usr/sbin/squid).
const EnvHAProxy = "PROXYFLEET_HAPROXY"

// frontEndProxies is how many upstream proxies every front end spreads
// its requests over.
const frontEndProxies = 3

// BenchmarkFrontEndVsSquid compares the gateway with what an operator
// would otherwise put in front of a fleet: Squid with the proxies as
// round-robin cache_peer parents, caching nothing (baseline). Both front
// ends run in processes of their own and spread the requests of
// [throughputClients] kept-alive clients over the same [frontEndProxies]
// upstream proxies, in front of the same origin; the clients, the
// proxies and the origin run in the benchmark's process. ns/op is the
// inverse of the throughput, so the ratio the bench-ratios script prints
// for gateway is squid's throughput over the gateway's: at most 1.0 when
// the gateway carries at least as many requests a second.
//
// Besides req/s it reports each request's latency at the client (p50-ms,
// p99-ms) and the CPU the front end's process used per request
// (fe-cpu-us/req), which the other work on a shared machine disturbs
// less than the rate, and the most it held resident since it started
// (fe-peak-rss-mb).
func BenchmarkFrontEndVsSquid(b *testing.B) {
	squid := frontEndBinary(b, squidtest.EnvSquid, "/usr/sbin/squid", "install Debian's squid (make squid-install, or apt-get install squid)")
	h := newFrontEnds(b)
	h.compare(b, h.startSquid(b, squid), h.startGateway(b))
}

// BenchmarkFrontEndVsHAProxy is [BenchmarkFrontEndVsSquid] with HAProxy
// in HTTP mode as the baseline: one backend with the proxies as servers,
// balance roundrobin. HAProxy relays an absolute-form request line as it
// came, which is what lets it stand in front of forward proxies; every
// upstream proxy here refuses any other form, so the benchmark fails if
// that stops being true.
func BenchmarkFrontEndVsHAProxy(b *testing.B) {
	haproxy := frontEndBinary(b, EnvHAProxy, "/usr/sbin/haproxy", "install Debian's haproxy (make haproxy-install, or apt-get install haproxy)")
	h := newFrontEnds(b)
	h.compare(b, h.startHAProxy(b, haproxy), h.startGateway(b))
}

// frontEndBinary returns the binary env names, or def; without it the
// benchmark is skipped (failed under PROXYFLEET_REQUIRE_INTEGRATION=1)
// with install, the way to get it.
func frontEndBinary(b *testing.B, env, def, install string) string {
	b.Helper()
	path := def
	if p := os.Getenv(env); p != "" {
		path = p
	}
	testgate.NeedFile(b, path, install)
	return path
}

// frontEnds is an origin and [frontEndProxies] upstream proxies in front
// of it, on loopback, for front ends to spread requests over.
type frontEnds struct {
	origin    string // URL
	upstreams []*countingProxy
	addrs     []string // of the upstreams
}

// countingProxy is an [upstreamProxy] that counts the requests it gets.
type countingProxy struct {
	next *upstreamProxy
	n    atomic.Int64
}

func (p *countingProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.n.Add(1)
	p.next.ServeHTTP(w, r)
}

func newFrontEnds(b *testing.B) *frontEnds {
	b.Helper()
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", fmt.Sprint(len(benchBody)))
		_, _ = w.Write(benchBody)
	}))
	b.Cleanup(origin.Close)
	h := &frontEnds{origin: origin.URL + "/page"}
	for range frontEndProxies {
		p := &countingProxy{next: newUpstreamProxy("")}
		h.upstreams = append(h.upstreams, p)
		h.addrs = append(h.addrs, serve(b, p))
	}
	return h
}

// frontEnd is one front end under test, running in a process of its own.
type frontEnd struct {
	name    string // the sub-benchmark's
	what    string // squid, haproxy or gateway, for messages
	addr    string
	pid     int
	gateway bool // its answers name the proxy that carried them
	stop    func(b *testing.B)
}

// compare measures each front end, started and checked to spread its
// requests over every upstream proxy, as a sub-benchmark, and stops them.
func (h *frontEnds) compare(b *testing.B, fes ...*frontEnd) {
	b.Helper()
	for _, fe := range fes {
		// One client for every round, so that rounds after the first
		// find their connections open.
		c := frontEndClient(fe.addr, throughputClients)
		b.Run(fe.name, func(b *testing.B) { h.throughput(b, fe, c) })
		c.CloseIdleConnections()
	}
	for _, fe := range fes {
		fe.stop(b)
	}
}

// frontEndClient returns a kept-alive client of the front end at addr that keeps
// up to conns connections to it, naming pool [benchPool] (which only the
// gateway reads).
func frontEndClient(addr string, conns int) *http.Client {
	return &http.Client{
		Timeout: 30 * time.Second,
		Transport: &http.Transport{
			Proxy:               http.ProxyURL(&url.URL{Scheme: "http", User: url.UserPassword(benchPool, "secret"), Host: addr}),
			MaxIdleConnsPerHost: conns,
			DisableCompression:  true,
		},
	}
}

// get fetches the origin's page through fe and checks the answer: a
// gateway's must name one of its proxies, any other's none.
func (h *frontEnds) get(c *http.Client, fe *frontEnd) error {
	resp, err := c.Get(h.origin)
	if err != nil {
		return fmt.Errorf("%s: %w", fe.what, err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	proxy := resp.Header.Get(forward.ProxyHeader)
	switch {
	case err != nil:
		return fmt.Errorf("%s: reading the body of %s: %w", fe.what, h.origin, err)
	case resp.StatusCode != http.StatusOK:
		return fmt.Errorf("%s: GET %s: status %s, want 200", fe.what, h.origin, resp.Status)
	case n != int64(len(benchBody)):
		return fmt.Errorf("%s: GET %s: %d bytes of body, want %d", fe.what, h.origin, n, len(benchBody))
	case fe.gateway && !slices.Contains(benchProxyIDs(frontEndProxies), proxy):
		return fmt.Errorf("%s: GET %s: %s %q, want one of %q", fe.what, h.origin, forward.ProxyHeader, proxy, benchProxyIDs(frontEndProxies))
	case !fe.gateway && proxy != "":
		return fmt.Errorf("%s: GET %s: %s %q, want none", fe.what, h.origin, forward.ProxyHeader, proxy)
	}
	return nil
}

// counts returns how many requests each upstream proxy got so far.
func (h *frontEnds) counts() []int64 {
	n := make([]int64, len(h.upstreams))
	for i, p := range h.upstreams {
		n[i] = p.n.Load()
	}
	return n
}

// checkSpread fails b unless the requests sent through fe since the
// counts were before all reached an upstream proxy (none was answered
// from a cache or by the front end itself) and each proxy got at least
// half its share: the front end balances over all of them, as a fleet's
// front end must.
func (h *frontEnds) checkSpread(b *testing.B, fe *frontEnd, before []int64, sent int) {
	b.Helper()
	after := h.counts()
	got := make([]int64, len(after))
	var sum int64
	for i := range after {
		got[i] = after[i] - before[i]
		sum += got[i]
	}
	if sum < int64(sent) {
		b.Fatalf("%s: the upstream proxies got %d requests (%v) of the %d sent: some were answered without them", fe.what, sum, got, sent)
	}
	if sent < 10*len(got) {
		return
	}
	for i, n := range got {
		if n < int64(sent/len(got)/2) {
			b.Fatalf("%s: upstream proxy %d got %d of %d requests (all: %v): the front end does not spread requests over every proxy", fe.what, i+1, n, sent, got)
		}
	}
}

// waitReady waits until fe answers a request (failing b when its process
// ended first or the answer is wrong), then checks over 60 requests one
// after another that it routes through every upstream proxy.
func (h *frontEnds) waitReady(b *testing.B, fe *frontEnd, exited <-chan struct{}, output func() string) {
	b.Helper()
	testwait.Until(b, 30*time.Second, fe.what+" listening on "+fe.addr, func() bool {
		select {
		case <-exited:
			b.Fatalf("%s exited before it listened:\n%s", fe.what, output())
		default:
		}
		c, err := net.Dial("tcp", fe.addr)
		if err != nil {
			return false
		}
		_ = c.Close()
		return true
	})
	c := frontEndClient(fe.addr, 1)
	defer c.CloseIdleConnections()
	before := h.counts()
	const n = 60
	for range n {
		if err := h.get(c, fe); err != nil {
			b.Fatalf("%v\n%s", err, output())
		}
	}
	h.checkSpread(b, fe, before, n)
}

// throughput is one round of a sub-benchmark: b.N requests from
// [throughputClients] clients at once through fe, with c.
func (h *frontEnds) throughput(b *testing.B, fe *frontEnd, c *http.Client) {
	b.SetParallelism((throughputClients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	var (
		mu  sync.Mutex
		lat = make([]time.Duration, 0, b.N)
	)
	before := h.counts()
	cpu := processCPU(b, fe.pid)
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		mine := make([]time.Duration, 0, 1024)
		defer func() {
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}()
		for pb.Next() {
			t0 := time.Now()
			if err := h.get(c, fe); err != nil {
				b.Error(err)
				return
			}
			mine = append(mine, time.Since(t0))
		}
	})
	elapsed := time.Since(start)
	cpu = processCPU(b, fe.pid) - cpu
	if b.Failed() {
		return
	}
	h.checkSpread(b, fe, before, b.N)
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
	b.ReportMetric(ms(percentile(lat, 0.50)), "p50-ms")
	b.ReportMetric(ms(percentile(lat, 0.99)), "p99-ms")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "fe-cpu-us/req")
	b.ReportMetric(peakRSSMB(b, fe.pid), "fe-peak-rss-mb")
}

// peakRSSMB returns the most process pid held resident so far, in MiB,
// from VmHWM in /proc/<pid>/status.
func peakRSSMB(b *testing.B, pid int) float64 {
	b.Helper()
	path := fmt.Sprintf("/proc/%d/status", pid)
	st, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	for l := range strings.Lines(string(st)) {
		v, ok := strings.CutPrefix(l, "VmHWM:")
		if !ok {
			continue
		}
		kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
		if err != nil {
			b.Fatalf("%s: VmHWM %q: %v", path, v, err)
		}
		return kb / 1024
	}
	b.Fatalf("%s: no VmHWM line", path)
	return 0
}

// percentile returns the p-quantile (0 < p ≤ 1) of sorted, 0 for none.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// processCPU returns the CPU time, user and system, of every thread of
// process pid so far, from /proc/<pid>/stat (in USER_HZ ticks, 100 a
// second on Linux).
func processCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	path := fmt.Sprintf("/proc/%d/stat", pid)
	st, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	// The fields after the command name, which is in parentheses and may
	// hold spaces: state is field 3, utime 14, stime 15.
	i := strings.LastIndexByte(string(st), ')')
	f := strings.Fields(string(st[i+1:]))
	if i < 0 || len(f) < 13 {
		b.Fatalf("%s: %q: want the fields of proc(5)", path, st)
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			b.Fatalf("%s: utime or stime %q: %v", path, s, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * (time.Second / 100)
}

// startGateway starts the gateway in a process of its own (the test
// binary again, see [TestForwardHelperProcess]), routing pool [benchPool]
// over the upstream proxies round-robin, its default.
func (h *frontEnds) startGateway(b *testing.B) *frontEnd {
	b.Helper()
	g := startHelper(b, "gateway", strings.Join(h.addrs, ","))
	fe := &frontEnd{name: "gateway", what: "gateway", addr: g.addr, pid: g.cmd.Process.Pid, gateway: true, stop: g.stop}
	exited := make(chan struct{}) // the helper's own checks stop it on error
	h.waitReady(b, fe, exited, func() string { return "" })
	return fe
}

// startSquid starts squid as an operator would put it in front of the
// proxies: each a round-robin parent, never going direct, caching
// nothing, serving loopback clients only; run in the foreground (-N),
// level-1 messages on stderr.
//
// Squid cannot listen on port 0. It binds its port with SO_REUSEPORT
// when asked for worker-queues, so the port is one the kernel chose and
// this process holds bound, never listening, until the benchmark ends
// ([testnet.Shared]): no other process can take it in between, and every
// connection reaches squid.
func (h *frontEnds) startSquid(b *testing.B, squid string) *frontEnd {
	b.Helper()
	addr := testnet.Shared(b)
	var conf strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&conf, format+"\n", args...) }
	line("http_port 127.0.0.1:%d worker-queues", addr.Port)
	line("pid_filename none")
	line("cache_log /dev/null")
	line("access_log none")
	line("netdb_filename none")
	line("logfile_rotate 0")
	line("pinger_enable off")
	line("cache deny all")
	line("shutdown_lifetime 1 seconds")
	if os.Geteuid() == 0 {
		_, err := user.Lookup("proxy")
		testgate.Need(b, err == nil, "squid started as root drops to the user proxy, which does not exist: install Debian's squid (make squid-install)")
		line("cache_effective_user proxy")
	}
	for i, a := range h.addrs {
		host, port, _ := net.SplitHostPort(a)
		line("cache_peer %s parent %s 0 no-query no-digest round-robin name=p%d", host, port, i+1)
	}
	line("never_direct allow all")
	line("http_access allow localhost")
	line("http_access deny all")
	path := filepath.Join(b.TempDir(), "squid.conf")
	if err := os.WriteFile(path, []byte(conf.String()), 0o644); err != nil {
		b.Fatal(err)
	}
	if err := squidtest.Parse(squid, path); err != nil {
		b.Fatal(err)
	}
	return h.startProcess(b, "squid", addr.String(), exec.Command(squid, "-N", "-d", "1", "-f", path), nil)
}

// startHAProxy starts HAProxy in HTTP mode with one backend, the proxies
// as its servers, balanced round-robin; everything else is HAProxy's
// defaults (keep-alive both sides, threads as many as CPUs), with
// timeouts set as its documentation asks. It listens on a socket this
// process opened on a port the kernel chose and hands it over as file
// descriptor 3 (bind fd@3).
func (h *frontEnds) startHAProxy(b *testing.B, haproxy string) *frontEnd {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	f, err := ln.(*net.TCPListener).File()
	_ = ln.Close() // f holds the socket
	if err != nil {
		b.Fatal(err)
	}
	var conf strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&conf, format+"\n", args...) }
	line("defaults")
	line("\tmode http")
	line("\ttimeout connect 5s")
	line("\ttimeout client 60s")
	line("\ttimeout server 60s")
	line("frontend fleet")
	line("\tbind fd@3")
	line("\tdefault_backend proxies")
	line("backend proxies")
	line("\tbalance roundrobin")
	for i, a := range h.addrs {
		line("\tserver p%d %s", i+1, a)
	}
	path := filepath.Join(b.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(conf.String()), 0o644); err != nil {
		b.Fatal(err)
	}
	return h.startProcess(b, "haproxy", ln.Addr().String(), exec.Command(haproxy, "-db", "-f", path), f)
}

// startProcess starts cmd, the baseline front end what, serving addr, handing it listener as fd 3 when
// not nil, waits until it is ready, and stops it (SIGTERM, then SIGKILL
// after 10 seconds) when the benchmark ends or stop is called.
func (h *frontEnds) startProcess(b *testing.B, what, addr string, cmd *exec.Cmd, listener *os.File) *frontEnd {
	b.Helper()
	var out testwait.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if listener != nil {
		cmd.ExtraFiles = []*os.File{listener}
	}
	err := cmd.Start()
	if listener != nil {
		_ = listener.Close() // the child's copy keeps it open
	}
	if err != nil {
		b.Fatal(err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
			}
		})
	}
	b.Cleanup(stop)
	fe := &frontEnd{name: "baseline", what: what, addr: addr, pid: cmd.Process.Pid, stop: func(*testing.B) { stop() }}
	output := func() string {
		select {
		case <-exited:
			return fmt.Sprintf("%s (%v):\n%s", cmd.Path, waitErr, out.String())
		default:
			return cmd.Path + ":\n" + out.String()
		}
	}
	h.waitReady(b, fe, exited, output)
	return fe
}
