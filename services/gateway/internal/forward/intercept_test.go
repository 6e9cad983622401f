package forward

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/intercept"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
)

// testCA is a CA made by package intercept, for the gateway or for an
// origin, with the pool that trusts it.
type testCA struct {
	ca    *intercept.CA
	pool  *x509.CertPool
	issue *intercept.Issuer
}

// newTestCA makes a CA valid from at and an issuer whose clock reads at.
func newTestCA(t *testing.T, at time.Time) *testCA {
	t.Helper()
	key, err := intercept.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	certPEM, err := intercept.SelfSign(key, at)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := intercept.ParseCA(certPEM, key)
	if err != nil {
		t.Fatal(err)
	}
	iss, err := intercept.NewIssuer(ca, 0, func() time.Time { return at })
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Certificate())
	return &testCA{ca: ca, pool: pool, issue: iss}
}

func (c *testCA) Issuer() (*intercept.Issuer, error) { return c.issue, nil }

// brokenCA is a gateway whose CA did not load.
type brokenCA struct{}

func (brokenCA) Issuer() (*intercept.Issuer, error) {
	return nil, errors.New("the CA key is sealed to another gateway key; give every gateway the same --key-file")
}

// tlsOrigin serves h over TLS on loopback with a certificate for host
// issued by ca.
func tlsOrigin(t *testing.T, ca *testCA, host string, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	cert, err := ca.issue.Certificate(host)
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewUnstartedServer(h)
	s.TLS = &tls.Config{Certificates: []tls.Certificate{*cert}}
	s.Config.ErrorLog = discardLog // the handshakes the tests fail on purpose
	s.StartTLS()
	t.Cleanup(s.Close)
	return s
}

// interceptHarness is a gateway whose pool p intercepts (unless spec says
// otherwise), with gw its CA and origins verified against originCA.
type interceptHarness struct {
	*harness
	gwCA *testCA
	// dials counts the client connections the gateway accepted.
	dials atomic.Int32
}

func newInterceptHarness(t *testing.T, fleet *recordingFleet, spec *events.GatewaySpec, gwCA CA, originCA *testCA, ups ...*upstream) *interceptHarness {
	t.Helper()
	return newInterceptHarnessLogged(t, fleet, spec, gwCA, originCA, nil, ups...)
}

// newInterceptHarnessLogged is newInterceptHarness with a request log.
func newInterceptHarnessLogged(t *testing.T, fleet *recordingFleet, spec *events.GatewaySpec, gwCA CA, originCA *testCA, log *reqlog.Logger, ups ...*upstream) *interceptHarness {
	t.Helper()
	if spec == nil {
		spec = &events.GatewaySpec{Intercept: true}
	}
	h := &interceptHarness{harness: &harness{t: t, table: route.NewTable(route.Limits{}, nil), fleet: fleet}}
	if c, ok := gwCA.(*testCA); ok {
		h.gwCA = c
	}
	h.table.SetSpec("p", spec)
	for i, u := range ups {
		h.table.Set(route.Proxy{ID: "p-" + string(rune('a'+i)), Pool: "p", Address: u.addr()})
	}
	h.srv = New(Config{Table: h.table, Fleet: fleet, Auth: func(_, _, pw string) (bool, error) { return pw != "wrong", nil },
		DialTimeout: 2 * time.Second, ResponseTimeout: 10 * time.Second, TunnelIdleTimeout: time.Minute,
		CA: gwCA, OriginRoots: originCA.pool, RequestLog: log})
	h.gw = httptest.NewUnstartedServer(h.srv)
	h.gw.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			h.dials.Add(1)
		}
	}
	h.gw.Start()
	t.Cleanup(h.gw.Close)
	t.Cleanup(h.srv.Close)
	return h
}

// trusting returns a client of the gateway as user that trusts roots
// (nil: the system's).
func (h *interceptHarness) trusting(user string, roots *x509.CertPool) *http.Client {
	u, _ := url.Parse(h.gw.URL)
	u.User = url.UserPassword(user, "x")
	tr := &http.Transport{Proxy: http.ProxyURL(u), TLSClientConfig: &tls.Config{RootCAs: roots}}
	h.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// connect dials the gateway and sends a CONNECT to target as pool p.
func (h *interceptHarness) connect(target string) (net.Conn, *bufio.Reader) {
	h.t.Helper()
	conn, err := net.Dial("tcp", h.gw.Listener.Addr().String())
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = conn.Close() })
	auth := base64.StdEncoding.EncodeToString([]byte("p:x"))
	_, _ = io.WriteString(conn, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\nProxy-Authorization: Basic "+auth+"\r\n\r\n")
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	return conn, bufio.NewReader(conn)
}

func TestInterceptedGETIsRelayedPerRequest(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	var sawTLS atomic.Int32
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) {
		if r.TLS != nil {
			sawTLS.Add(1)
		}
		if r.Header.Get("Proxy-Authorization") != "" {
			t.Errorf("the origin got a Proxy-Authorization header")
		}
		_, _ = io.WriteString(w, "secure "+r.URL.Path)
	})
	ups := []*upstream{newUpstream(t, "crawl:pw"), newUpstream(t, "crawl:pw"), newUpstream(t, "crawl:pw")}
	h := newInterceptHarness(t, &recordingFleet{user: "crawl", password: "pw"}, nil, gwCA, originCA, ups...)
	c := h.trusting("p", gwCA.pool)
	seen := map[string]int{}
	for i := range 6 {
		code, body, hdr := get(t, c, site.URL+"/x")
		if code != 200 || body != "secure /x" {
			t.Fatalf("HTTPS request %d through an intercepting pool: %d %q", i, code, body)
		}
		seen[hdr.Get(ProxyHeader)]++
	}
	// Keep-alive inside: one tunnel carried the six requests, and each
	// was routed on its own (round-robin over the three proxies).
	if n := h.dials.Load(); n != 1 {
		t.Errorf("the client opened %d connections to the gateway for 6 requests; want 1 kept alive", n)
	}
	if len(seen) != 3 || seen["p-a"] != 2 || seen["p-b"] != 2 || seen["p-c"] != 2 {
		t.Errorf("%s per request: %v; want 2 each of p-a, p-b, p-c", ProxyHeader, seen)
	}
	if sawTLS.Load() != 6 {
		t.Errorf("the origin saw %d TLS requests; want 6", sawTLS.Load())
	}
	for _, u := range ups {
		u.mu.Lock()
		for _, a := range u.seenAuth {
			if a != "Basic "+base64.StdEncoding.EncodeToString([]byte("crawl:pw")) {
				t.Errorf("upstream got Proxy-Authorization %q; want the pool's credentials", a)
			}
		}
		u.mu.Unlock()
	}
	if st := h.srv.Stats().Snapshot()["p"]; st.Proxies["p-a"].Requests != 2 || st.Proxies["p-a"].BytesDown != int64(len("secure /x"))*2 {
		t.Errorf("stats of p-a: %+v; want 2 requests with their bodies counted", st.Proxies["p-a"])
	}
}

func TestInterceptedSessionPinsAndBanRuleSeesTheBody(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/captcha" {
			_, _ = io.WriteString(w, "<html>please solve this CAPTCHA</html>")
			return
		}
		_, _ = io.WriteString(w, "ok")
	})
	rules, err := ban.Compile([]events.BanRule{{Name: "captcha", Body: "(?i)captcha", Threshold: 2}})
	if err != nil {
		t.Fatal(err)
	}
	f := &recordingFleet{rules: rules}
	// No retries: every proxy gets the captcha here, and a retried ban
	// page would count against each of them.
	noRetries := 0
	spec := &events.GatewaySpec{Intercept: true, Retries: &noRetries}
	h := newInterceptHarness(t, f, spec, gwCA, originCA, newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, ""))
	c := h.trusting("p.session-abc", gwCA.pool)
	var pinned string
	for i := range 5 {
		_, _, hdr := get(t, c, site.URL+"/")
		if i == 0 {
			pinned = hdr.Get(ProxyHeader)
		} else if got := hdr.Get(ProxyHeader); got != pinned {
			t.Fatalf("request %d of session abc went through %s; the first through %s", i, got, pinned)
		}
		if i == 2 {
			c.Transport.(*http.Transport).CloseIdleConnections() // a new tunnel, the same session
		}
	}
	if pinned == "" {
		t.Fatal("no proxy named")
	}
	for range 2 {
		if code, body, hdr := get(t, c, site.URL+"/captcha"); code != 200 || !strings.Contains(body, "CAPTCHA") || hdr.Get("X-Proxyfleet-Banned") != "captcha" {
			t.Fatalf("captcha page: %d %q (X-Proxyfleet-Banned %q); want it relayed whole, marked by its rule", code, body, hdr.Get("X-Proxyfleet-Banned"))
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.banned) != 1 || f.banned[0].Proxy != pinned || f.banned[0].Rule != "captcha" {
		t.Errorf("ban reports: %+v; want one of %s by captcha (the rule saw the HTTPS body)", f.banned, pinned)
	}
}

func TestPoolWithoutInterceptStillTunnelsOpaquely(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "secure") })
	h := newInterceptHarness(t, &recordingFleet{}, &events.GatewaySpec{}, gwCA, originCA, newUpstream(t, ""))
	// The client talks TLS with the origin itself: it must trust the
	// origin's CA, and the gateway's certificate is never shown.
	if _, err := h.trusting("p", gwCA.pool).Get(site.URL); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a client trusting only the gateway CA, through an opaque tunnel: %v; want the origin's certificate refused", err)
	}
	code, body, hdr := get(t, h.trusting("p", originCA.pool), site.URL)
	if code != 200 || body != "secure" || hdr.Get(ProxyHeader) != "" {
		t.Errorf("through an opaque tunnel: %d %q %s=%q; want the origin's 200 without the gateway's header", code, body, ProxyHeader, hdr.Get(ProxyHeader))
	}
}

func TestInterceptRefusesBadInput(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	h := newInterceptHarness(t, &recordingFleet{}, nil, gwCA, originCA, newUpstream(t, ""))
	target := site.Listener.Addr().String()

	t.Run("malformed CONNECT target", func(t *testing.T) {
		_, br := h.connect("no-port")
		resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
		if err != nil || resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("CONNECT no-port: %v %v; want 400", resp, err)
		}
	})
	t.Run("huge header inside TLS", func(t *testing.T) {
		conn, br := h.connect(target)
		if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %v %v", resp, err)
		}
		tc := tls.Client(conn, &tls.Config{RootCAs: gwCA.pool, ServerName: "127.0.0.1"})
		big := strings.Repeat("a", 2<<20)
		go func() {
			_, _ = io.WriteString(tc, "GET / HTTP/1.1\r\nHost: "+target+"\r\nX-Big: "+big+"\r\n\r\n")
		}()
		resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
		if err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("a 2 MiB header inside the tunnel: %v %v; want 431", resp, err)
		}
	})
	t.Run("no ClientHello", func(t *testing.T) {
		_, br := h.connect(target)
		if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %v %v", resp, err)
		}
		// The gateway waits its dial timeout (2s here) for the
		// handshake, then closes; the read ends well before the
		// connection's own 20s deadline.
		_, err := br.ReadByte()
		if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
			t.Fatalf("a client that sends no ClientHello is still connected after 20s")
		}
		if err == nil {
			t.Fatalf("the gateway sent bytes to a client that sent no ClientHello")
		}
	})
	t.Run("client does not trust the CA", func(t *testing.T) {
		_, err := h.trusting("p", x509.NewCertPool()).Get(site.URL)
		if _, ok := errors.AsType[*tls.CertificateVerificationError](err); !ok {
			t.Fatalf("a client that does not trust the gateway CA: %v; want its handshake to fail verification", err)
		}
	})
	h.fleet.mu.Lock()
	defer h.fleet.mu.Unlock()
	if h.fleet.suspects != nil {
		t.Errorf("bad input reported proxies: %v", h.fleet.suspects)
	}
}

func TestInterceptWithoutCAIs503(t *testing.T) {
	originCA := newTestCA(t, time.Now())
	h := newInterceptHarness(t, &recordingFleet{}, nil, brokenCA{}, originCA, newUpstream(t, ""))
	_, br := h.connect("example.test:443")
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "--key-file") || !strings.Contains(string(body), "intercepts HTTPS") {
		t.Errorf("CONNECT with no usable CA: %d %q; want 503 saying why", resp.StatusCode, body)
	}
}

func TestOriginCertificateFailureIs502NotTheProxys(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	past := newTestCA(t, time.Now().Add(-30*24*time.Hour))
	for _, c := range []struct {
		name string
		site *httptest.Server
		says string
	}{
		{"expired", tlsOrigin(t, past, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) {}), "certificate has expired"},
		{"wrong host", tlsOrigin(t, originCA, "other.example", func(w http.ResponseWriter, r *http.Request) {}), "cannot validate certificate for 127.0.0.1"},
		{"unknown CA", tlsOrigin(t, newTestCA(t, time.Now()), "127.0.0.1", func(w http.ResponseWriter, r *http.Request) {}), "unknown authority"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ups := []*upstream{newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, "")}
			// past's certificate verifies against originCA's pool only
			// when past is trusted too: trust it, so expiry is the
			// failure.
			roots := originCA.pool.Clone()
			roots.AddCert(past.ca.Certificate())
			originCA := &testCA{ca: originCA.ca, pool: roots, issue: originCA.issue}
			h := newInterceptHarness(t, &recordingFleet{}, nil, gwCA, originCA, ups...)
			code, body, _ := get(t, h.trusting("p", gwCA.pool), c.site.URL+"/")
			host := "127.0.0.1"
			if code != http.StatusBadGateway || !strings.Contains(body, "origin certificate for host "+host) || !strings.Contains(body, c.says) {
				t.Errorf("origin with a bad certificate: %d %q; want 502 naming %q", code, body, c.says)
			}
			if n := ups[0].requests.Load() + ups[1].requests.Load() + ups[2].requests.Load(); n != 1 {
				t.Errorf("attempts: %d; want 1 (no retry on another proxy)", n)
			}
			h.fleet.mu.Lock()
			defer h.fleet.mu.Unlock()
			if len(h.fleet.suspects) != 0 {
				t.Errorf("suspects: %v; want none (the origin failed, not the proxy)", h.fleet.suspects)
			}
			if x, err := h.table.Pick(route.Target{Pool: "p"}); err != nil || x.ID != "p-b" {
				t.Errorf("next pick %v %v; want p-b (round-robin goes on, nothing cooled)", x, err)
			}
		})
	}
}

func TestOriginRootsRefusesBadFiles(t *testing.T) {
	dir := t.TempDir()
	noPEM := filepath.Join(dir, "nopem.pem")
	if err := os.WriteFile(noPEM, []byte("not a certificate\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(good, newTestCA(t, time.Now()).ca.PEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ file, says string }{
		{filepath.Join(dir, "missing.pem"), "no such file"},
		{noPEM, "holds no PEM certificate"},
		{dir, "is a directory"},
	} {
		if _, err := OriginRoots(c.file); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("OriginRoots(%s): %v; want an error saying %q", c.file, err, c.says)
		}
	}
	if p, err := OriginRoots(good); err != nil || p == nil {
		t.Errorf("OriginRoots of a good bundle: %v", err)
	}
	if p, err := OriginRoots(""); err != nil || p == nil {
		t.Errorf("OriginRoots without a file: %v", err)
	}
}

// TestInterceptedOriginIsHTTPSOnTheConnectHost: a request inside the
// tunnel goes to https://<CONNECT host>, port kept, whatever its own
// request line says.
func TestInterceptedOriginIsHTTPSOnTheConnectHost(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, r.Host+" "+r.URL.RequestURI())
	})
	h := newInterceptHarness(t, &recordingFleet{}, nil, gwCA, originCA, newUpstream(t, ""))
	target := site.Listener.Addr().String()
	conn, br := h.connect(target)
	if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	tc := tls.Client(conn, &tls.Config{RootCAs: gwCA.pool, ServerName: "127.0.0.1", NextProtos: []string{"h2", "http/1.1"}})
	if err := tc.HandshakeContext(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != "http/1.1" {
		t.Errorf("ALPN inside interception: %q; want http/1.1", p)
	}
	_, _ = io.WriteString(tc, "GET /a?b=c HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(body) != target+" /a?b=c" {
		t.Errorf("inside the tunnel: %d %q; want the origin at %s to get /a?b=c", resp.StatusCode, body, target)
	}
}
