package forward_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/intercept"
	"proxyfleet/services/gateway/internal/route"
)

// The pool every benchmark client names, and the one proxy it holds.
const (
	benchPool    = "bench"
	benchProxyID = "px-bench"
)

// benchAuth is the Proxy-Authorization a benchmark client sends: the pool
// as username. The upstream proxy ignores it, so the baseline's requests
// are byte for byte the gateway's.
var benchAuth = "Basic " + base64.StdEncoding.EncodeToString([]byte(benchPool+":secret"))

// benchBody is the origin's fixed response body.
var benchBody = bytes.Repeat([]byte("proxyfleet "), 100)

// throughputClients is how many clients send requests at once in
// BenchmarkGatewayThroughput.
const throughputClients = 32

// BenchmarkGatewayRequest measures the latency of one small GET through
// the gateway against the same GET through the upstream proxy alone, in
// the same run: baseline is client → upstream proxy → origin, gateway is
// client → gateway → the same upstream proxy → origin. two-proxies is
// client → a second minimal proxy → the same upstream proxy → origin: the
// cost of any Go proxy hop in front of the upstream, which the gateway's
// own work adds to. Each client sends its requests one after another over
// kept-alive connections, so ns/op is the latency of one request.
// Everything runs on loopback in this process. Goal: gateway ≤ 1.3×
// baseline.
func BenchmarkGatewayRequest(b *testing.B) {
	h := newBenchHarness(b)
	for _, v := range h.vias() {
		b.Run(v.name, func(b *testing.B) {
			c := h.client(v.addr, 1)
			defer c.CloseIdleConnections()
			// Open the kept-alive connections of every hop first.
			if err := h.get(c, v.wantProxy); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if err := h.get(c, v.wantProxy); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	h.check(b)
}

// BenchmarkGatewayThroughput measures requests per second with
// [throughputClients] clients at once, through the gateway against the
// upstream proxy alone (the same paths as [BenchmarkGatewayRequest],
// two-proxies included).
// ns/op is the inverse of the throughput: goal ≥ 0.7× the baseline's
// throughput, that is gateway ns/op ≤ 1.43× baseline ns/op.
func BenchmarkGatewayThroughput(b *testing.B) {
	h := newBenchHarness(b)
	for _, v := range h.vias() {
		b.Run(v.name, func(b *testing.B) {
			c := h.client(v.addr, throughputClients)
			defer c.CloseIdleConnections()
			b.SetParallelism((throughputClients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := h.get(c, v.wantProxy); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
		})
	}
	h.check(b)
}

// BenchmarkGatewayConnect measures opening a CONNECT tunnel to an echo
// server and carrying one round trip through it: baseline through the
// upstream proxy alone, gateway through the gateway and the same upstream
// proxy. Each op dials a new connection, as a crawler opening a TLS
// connection does.
func BenchmarkGatewayConnect(b *testing.B) {
	h := newBenchHarness(b)
	msg := []byte("ping through the tunnel\n")
	for _, v := range h.vias()[:2] {
		b.Run(v.name, func(b *testing.B) {
			for b.Loop() {
				c, err := openTunnel(v.addr, h.echo, v.wantProxy)
				if err != nil {
					b.Fatal(err)
				}
				err = echoRoundTrip(c, msg)
				_ = c.Close()
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	h.check(b)
}

// benchHarness is an origin, an echo server, one upstream forward proxy
// in front of them, a gateway routing pool [benchPool] to that proxy and
// a second minimal proxy relaying to it, all on loopback.
type benchHarness struct {
	origin   string // URL
	echo     string // host:port
	upstream string // host:port
	gateway  string // host:port
	second   string // host:port
	fleet    *benchFleet
}

func newBenchHarness(b *testing.B) *benchHarness {
	b.Helper()
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", fmt.Sprint(len(benchBody)))
		_, _ = w.Write(benchBody)
	}))
	b.Cleanup(origin.Close)
	h := &benchHarness{origin: origin.URL + "/page", echo: newEcho(b), upstream: serve(b, newUpstreamProxy(""))}
	h.gateway, h.fleet = newGateway(b, h.upstream)
	h.second = serve(b, newUpstreamProxy(h.upstream))
	return h
}

// benchVia is one path a benchmark's clients take: the proxy they talk
// to and the X-Proxyfleet-Proxy every answer must carry ("" for none).
type benchVia struct {
	name, addr, wantProxy string
}

func (h *benchHarness) vias() []benchVia {
	return []benchVia{
		{name: "baseline", addr: h.upstream},
		{name: "gateway", addr: h.gateway, wantProxy: benchProxyID},
		{name: "two-proxies", addr: h.second},
	}
}

// client returns a kept-alive client of the forward proxy at addr that
// keeps up to conns idle connections to it.
func (h *benchHarness) client(addr string, conns int) *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               http.ProxyURL(&url.URL{Scheme: "http", User: url.UserPassword(benchPool, "secret"), Host: addr}),
		MaxIdleConnsPerHost: conns,
		DisableCompression:  true,
	}}
}

// get fetches the origin's page through c's proxy and checks the answer,
// including who carried it: a baseline answer must not have passed the
// gateway, and a gateway answer must have.
func (h *benchHarness) get(c *http.Client, wantProxy string) error {
	resp, err := c.Get(h.origin)
	if err != nil {
		return err
	}
	n, err := io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	switch {
	case err != nil:
		return fmt.Errorf("reading the body of %s: %w", h.origin, err)
	case resp.StatusCode != http.StatusOK:
		return fmt.Errorf("GET %s: status %s, want 200", h.origin, resp.Status)
	case n != int64(len(benchBody)):
		return fmt.Errorf("GET %s: %d bytes of body, want %d", h.origin, n, len(benchBody))
	case resp.Header.Get(forward.ProxyHeader) != wantProxy:
		return fmt.Errorf("GET %s: %s %q, want %q", h.origin, forward.ProxyHeader, resp.Header.Get(forward.ProxyHeader), wantProxy)
	}
	return nil
}

// check fails b if the gateway found the upstream proxy failing: its
// figures would then include retries.
func (h *benchHarness) check(b *testing.B) {
	b.Helper()
	if n, reason := h.fleet.suspected(); n > 0 {
		b.Errorf("the gateway reported the upstream proxy suspect %d times (last: %s)", n, reason)
	}
}

// newGateway serves a gateway routing pool [benchPool] to the proxies at
// upstreams (by its default strategy, round-robin), and returns its
// address. The first proxy's id is [benchProxyID], the others' that with
// "-2", "-3"… appended ([benchProxyIDs]).
func newGateway(tb testing.TB, upstreams ...string) (string, *benchFleet) {
	tb.Helper()
	table := route.NewTable(route.Limits{}, nil)
	for i, id := range benchProxyIDs(len(upstreams)) {
		table.Set(route.Proxy{ID: id, Pool: benchPool, Address: upstreams[i]})
	}
	fleet := &benchFleet{}
	srv := forward.New(forward.Config{
		Table: table,
		Fleet: fleet,
		Auth:  func(_, pool, _ string) (bool, error) { return pool == benchPool, nil },
	})
	tb.Cleanup(srv.Close)
	return serve(tb, srv), fleet
}

// benchProxyIDs returns the ids [newGateway] gives n proxies.
func benchProxyIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = benchProxyID
		if i > 0 {
			ids[i] += fmt.Sprintf("-%d", i+1)
		}
	}
	return ids
}

// serve serves h on a loopback port, as cmd/gateway serves the gateway,
// until tb ends, and returns its address.
func serve(tb testing.TB, h http.Handler) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
	go func() { _ = srv.Serve(ln) }()
	tb.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// benchFleet is a fleet of one pool, [benchPool], whose proxies demand no
// credentials and which has no ban rules. It records suspect reports.
type benchFleet struct {
	mu       sync.Mutex
	suspects int
	reason   string
}

var _ forward.Fleet = (*benchFleet)(nil)

func (f *benchFleet) Known(pool string) bool { return pool == benchPool }

func (f *benchFleet) Credentials(route.Proxy) (string, string, error) { return "", "", nil }

func (f *benchFleet) Rules(string) []ban.Rule { return nil }

func (f *benchFleet) Suspect(id, reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.suspects++
	f.reason = id + ": " + reason
}

func (f *benchFleet) Banned(string, ban.Verdict) {}

func (f *benchFleet) suspected() (int, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.suspects, f.reason
}

// upstreamProxy is a minimal forward proxy standing for a fleet member:
// it relays absolute-form requests over its own kept-alive transport and
// tunnels CONNECT by hijacking the client's connection and copying both
// ways.
type upstreamProxy struct {
	transport *http.Transport
}

// newUpstreamProxy returns a proxy that relays plain requests to their
// origin, or through the proxy at next when next is not "" (its tunnels
// always go straight to their target).
func newUpstreamProxy(next string) *upstreamProxy {
	var proxy func(*http.Request) (*url.URL, error)
	if next != "" {
		proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: next})
	}
	return &upstreamProxy{transport: &http.Transport{
		Proxy:               proxy,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}}
}

func (p *upstreamProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect {
		p.tunnel(w, r)
		return
	}
	if !r.URL.IsAbs() {
		http.Error(w, "upstream proxy: absolute-form request required", http.StatusBadRequest)
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Close = false
	out.Header.Del("Proxy-Authorization")
	out.Header.Del("Proxy-Connection")
	if r.ContentLength == 0 {
		out.Body = nil
	}
	resp, err := p.transport.RoundTrip(out)
	if err != nil {
		http.Error(w, "upstream proxy: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

func (p *upstreamProxy) tunnel(w http.ResponseWriter, r *http.Request) {
	up, err := net.DialTimeout("tcp", r.Host, 10*time.Second)
	if err != nil {
		http.Error(w, "upstream proxy: "+err.Error(), http.StatusBadGateway)
		return
	}
	down, brw, err := w.(http.Hijacker).Hijack()
	if err != nil {
		_ = up.Close()
		return
	}
	_, err = io.WriteString(down, "HTTP/1.1 200 Connection established\r\n\r\n")
	if err == nil && brw.Reader.Buffered() > 0 {
		b, _ := brw.Reader.Peek(brw.Reader.Buffered())
		_, err = up.Write(b)
	}
	if err != nil {
		_ = down.Close()
		_ = up.Close()
		return
	}
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(up, down)
		_ = up.Close()
		_ = down.Close()
		close(done)
	}()
	_, _ = io.Copy(down, up)
	_ = up.Close()
	_ = down.Close()
	<-done
}

// newEcho serves a TCP echo on a loopback port until tb ends and returns
// its address.
func newEcho(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			go func() {
				// A small buffer and no splice: the echo's share of
				// the process stays small and holds no pipes.
				buf := make([]byte, 512)
				_, _ = io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, buf)
				_ = c.Close()
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
			}()
		}
	}()
	tb.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}

// openTunnel asks the forward proxy at via for a tunnel to target, as
// pool [benchPool], and checks that the proxy named wantProxy carried it
// ("" for an answer without [forward.ProxyHeader]).
func openTunnel(via, target, wantProxy string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", via, 10*time.Second)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	req := "CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\nProxy-Authorization: " + benchAuth + "\r\n\r\n"
	if _, err := io.WriteString(c, req); err != nil {
		_ = c.Close()
		return nil, err
	}
	br := bufio.NewReaderSize(c, 256)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("CONNECT %s via %s: %w", target, via, err)
	}
	var bad error
	switch {
	case resp.StatusCode != http.StatusOK:
		bad = fmt.Errorf("CONNECT %s via %s: status %s, want 200", target, via, resp.Status)
	case resp.Header.Get(forward.ProxyHeader) != wantProxy:
		bad = fmt.Errorf("CONNECT %s via %s: %s %q, want %q", target, via, forward.ProxyHeader, resp.Header.Get(forward.ProxyHeader), wantProxy)
	case br.Buffered() > 0:
		bad = fmt.Errorf("CONNECT %s via %s: %d bytes before the tunnel carried any", target, via, br.Buffered())
	}
	if bad != nil {
		_ = c.Close()
		return nil, bad
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// echoRoundTrip sends msg through a tunnel to the echo server and checks
// that it comes back.
func echoRoundTrip(c net.Conn, msg []byte) error {
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	defer func() { _ = c.SetDeadline(time.Time{}) }()
	if _, err := c.Write(msg); err != nil {
		return fmt.Errorf("writing to the tunnel: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("reading the echo from the tunnel: %w", err)
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("the tunnel echoed %q, want %q", got, msg)
	}
	return nil
}

// firstError keeps the first error of concurrent workers.
type firstError struct {
	once sync.Once
	err  atomic.Pointer[error]
}

func (f *firstError) set(err error) {
	f.once.Do(func() { f.err.Store(&err) })
}

func (f *firstError) get() error {
	if p := f.err.Load(); p != nil {
		return *p
	}
	return nil
}

// BenchmarkGatewayIntercept measures HTTPS requests per second with
// [throughputClients] kept-alive clients at once, to one TLS origin
// through one upstream proxy:
//
//   - baseline: the pool does not intercept: each client's TLS goes to
//     the origin through an opaque CONNECT tunnel of the gateway;
//   - intercept: the pool intercepts (gateway.intercept): the gateway
//     terminates each client's TLS with a leaf of its CA and relays every
//     request through the same proxy with TLS of its own to the origin.
//
// req/s is each path's throughput; intercept-x-baseline (reported by
// intercept) is its req/s over the baseline's of the same run. Goal: at
// least 0.5, that is intercept ns/op at most 2× baseline ns/op in make
// bench's ratio lines.
func BenchmarkGatewayIntercept(b *testing.B) {
	h := newInterceptBench(b)
	var baseline float64
	for _, v := range h.vias() {
		b.Run(v.name, func(b *testing.B) {
			c := h.client(v, throughputClients)
			defer c.CloseIdleConnections()
			b.SetParallelism((throughputClients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := h.get(c, v.wantProxy); err != nil {
						b.Error(err)
						return
					}
				}
			})
			rate := float64(b.N) / time.Since(start).Seconds()
			b.ReportMetric(rate, "req/s")
			if v.name == "baseline" {
				baseline = rate
			} else if baseline > 0 {
				b.ReportMetric(rate/baseline, "intercept-x-baseline")
			}
		})
	}
	h.check(b)
}

// BenchmarkGatewayInterceptRequest measures the latency of one HTTPS GET
// over a kept-alive connection, one client sending one request after
// another, on the paths of [BenchmarkGatewayIntercept].
func BenchmarkGatewayInterceptRequest(b *testing.B) {
	h := newInterceptBench(b)
	for _, v := range h.vias() {
		b.Run(v.name, func(b *testing.B) {
			c := h.client(v, 1)
			defer c.CloseIdleConnections()
			if err := h.get(c, v.wantProxy); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if err := h.get(c, v.wantProxy); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	h.check(b)
}

// interceptIdleConns is how many idle intercepted connections
// BenchmarkGatewayInterceptIdle holds.
const interceptIdleConns = 500

// BenchmarkGatewayInterceptIdle opens [interceptIdleConns] intercepted
// connections, each carrying one HTTPS request and then left idle, and
// reports the Go heap and stacks they hold (bytes/conn, after a GC). The
// clients run in this process, so the figure includes each client's own
// TLS connection: an upper bound of the gateway's share. ns/op is not a
// result (reported as 0).
func BenchmarkGatewayInterceptIdle(b *testing.B) {
	h := newInterceptBench(b)
	var perConn float64
	b.Run("intercept", func(b *testing.B) {
		// One measurement whatever b.N: the result is memory, not a rate.
		if perConn == 0 {
			perConn = h.idleBytesPerConn(b, interceptIdleConns)
		}
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(0, "B/op")
		b.ReportMetric(0, "allocs/op")
		b.ReportMetric(interceptIdleConns, "conns")
		b.ReportMetric(perConn, "bytes/conn")
	})
	h.check(b)
}

// interceptBench is a TLS origin with a CA of its own, one upstream proxy
// in front of it and two gateways routing pool [benchPool] to that proxy,
// one intercepting (with a CA of its own) and one not.
type interceptBench struct {
	*benchHarness
	originCA, gatewayCA  *x509.CertPool
	opaque, intercepting string // the gateways' addresses
	fleet                *benchFleet
}

// benchCA is the gateway's CA as forward.Config takes it.
type benchCA struct{ issuer *intercept.Issuer }

func (c benchCA) Issuer() (*intercept.Issuer, error) { return c.issuer, nil }

// newBenchCA makes a CA and its issuer.
func newBenchCA(tb testing.TB) (*intercept.Issuer, *x509.CertPool) {
	tb.Helper()
	key, err := intercept.NewKey()
	if err != nil {
		tb.Fatal(err)
	}
	certPEM, err := intercept.SelfSign(key, time.Now())
	if err != nil {
		tb.Fatal(err)
	}
	ca, err := intercept.ParseCA(certPEM, key)
	if err != nil {
		tb.Fatal(err)
	}
	iss, err := intercept.NewIssuer(ca, 0, nil)
	if err != nil {
		tb.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Certificate())
	return iss, pool
}

func newInterceptBench(b *testing.B) *interceptBench {
	b.Helper()
	originIssuer, originCA := newBenchCA(b)
	gatewayIssuer, gatewayCA := newBenchCA(b)
	cert, err := originIssuer.Certificate("127.0.0.1")
	if err != nil {
		b.Fatal(err)
	}
	origin := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", fmt.Sprint(len(benchBody)))
		_, _ = w.Write(benchBody)
	}))
	origin.TLS = &tls.Config{Certificates: []tls.Certificate{*cert}}
	// Clients that close kept-alive connections at the end make the
	// origin log handshake errors of no interest.
	origin.Config.ErrorLog = log.New(io.Discard, "", 0)
	origin.StartTLS()
	b.Cleanup(origin.Close)
	upstream := serve(b, newUpstreamProxy(""))
	fleet := &benchFleet{}
	h := &interceptBench{
		benchHarness: &benchHarness{origin: origin.URL + "/page", upstream: upstream, fleet: fleet},
		originCA:     originCA, gatewayCA: gatewayCA, fleet: fleet,
	}
	for _, v := range []struct {
		addr *string
		spec *events.GatewaySpec
	}{{&h.opaque, nil}, {&h.intercepting, &events.GatewaySpec{Intercept: true}}} {
		table := route.NewTable(route.Limits{}, nil)
		table.Set(route.Proxy{ID: benchProxyID, Pool: benchPool, Address: upstream})
		table.SetSpec(benchPool, v.spec)
		srv := forward.New(forward.Config{
			Table:       table,
			Fleet:       fleet,
			Auth:        func(_, pool, _ string) (bool, error) { return pool == benchPool, nil },
			CA:          benchCA{gatewayIssuer},
			OriginRoots: originCA,
		})
		b.Cleanup(srv.Close)
		*v.addr = serve(b, srv)
	}
	return h
}

// interceptVia is a path of [BenchmarkGatewayIntercept]: the gateway the
// clients talk to, the CA they trust and the X-Proxyfleet-Proxy every
// answer must carry.
type interceptVia struct {
	name, addr, wantProxy string
	roots                 *x509.CertPool
}

func (h *interceptBench) vias() []interceptVia {
	return []interceptVia{
		{name: "baseline", addr: h.opaque, roots: h.originCA},
		{name: "intercept", addr: h.intercepting, roots: h.gatewayCA, wantProxy: benchProxyID},
	}
}

// client returns a kept-alive HTTPS client of the gateway on v's path.
func (h *interceptBench) client(v interceptVia, conns int) *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               http.ProxyURL(&url.URL{Scheme: "http", User: url.UserPassword(benchPool, "secret"), Host: v.addr}),
		TLSClientConfig:     &tls.Config{RootCAs: v.roots},
		MaxIdleConnsPerHost: conns,
		DisableCompression:  true,
	}}
}

// idleBytesPerConn opens n intercepted connections, each carrying one
// request, and returns the growth of the Go heap and stacks they cause
// per connection, with all of them open and idle.
func (h *interceptBench) idleBytesPerConn(b *testing.B, n int) float64 {
	b.Helper()
	target := strings.TrimPrefix(strings.TrimSuffix(h.origin, "/page"), "https://")
	inUse := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapInuse + m.StackInuse
	}
	// One connection first, so what every connection shares (the leaf,
	// the kept-alive connection to the proxy) is there before.
	conns := make([]net.Conn, 0, n+1)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	open := func() {
		c, err := openTunnel(h.intercepting, target, "")
		if err != nil {
			b.Fatal(err)
		}
		tc := tls.Client(c, &tls.Config{RootCAs: h.gatewayCA, ServerName: "127.0.0.1"})
		conns = append(conns, tc)
		_ = tc.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.WriteString(tc, "GET /page HTTP/1.1\r\nHost: "+target+"\r\n\r\n"); err != nil {
			b.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReaderSize(tc, 512), nil)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get(forward.ProxyHeader) != benchProxyID {
			b.Fatalf("an intercepted GET: %s via %q", resp.Status, resp.Header.Get(forward.ProxyHeader))
		}
		_ = tc.SetDeadline(time.Time{})
	}
	open()
	before := inUse()
	for range n {
		open()
	}
	after := inUse()
	return float64(after-before) / float64(n)
}
