package forward

import (
	"crypto/tls"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/route"
)

// upstream is a real forward proxy on loopback, as the fleet's proxies
// are: it relays absolute-form requests and tunnels CONNECT. It can demand
// basic auth, answer every request with a fixed status, or be closed.
type upstream struct {
	t        *testing.T
	srv      *httptest.Server
	auth     string // "user:password" it demands, "" for none
	status   atomic.Int32
	requests atomic.Int32
	mu       sync.Mutex
	seenAuth []string // Proxy-Authorization values it received
	seenHdr  []http.Header
}

func newUpstream(t *testing.T, auth string) *upstream {
	u := &upstream{t: t, auth: auth}
	tr := &http.Transport{}
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.requests.Add(1)
		u.mu.Lock()
		u.seenAuth = append(u.seenAuth, r.Header.Get("Proxy-Authorization"))
		u.seenHdr = append(u.seenHdr, r.Header.Clone())
		u.mu.Unlock()
		if u.auth != "" && r.Header.Get("Proxy-Authorization") != "Basic "+base64.StdEncoding.EncodeToString([]byte(u.auth)) {
			w.Header().Set("Proxy-Authenticate", `Basic realm="upstream"`)
			w.WriteHeader(http.StatusProxyAuthRequired)
			return
		}
		if s := u.status.Load(); s != 0 {
			// An error page of the proxy's own, marked as proxyfleet's
			// proxies mark theirs.
			w.Header().Set(events.ProxyErrorHeader, "squid ERR_CONNECT_FAIL")
			w.WriteHeader(int(s))
			return
		}
		if r.Method == http.MethodConnect {
			origin, err := net.Dial("tcp", r.Host)
			if err != nil {
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			w.WriteHeader(http.StatusOK)
			client, rw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				_ = origin.Close()
				return
			}
			if n := rw.Reader.Buffered(); n > 0 {
				b, _ := rw.Reader.Peek(n)
				_, _ = origin.Write(b)
			}
			go func() { _, _ = io.Copy(origin, client); _ = origin.Close() }()
			_, _ = io.Copy(client, origin)
			_ = client.Close()
			return
		}
		out := r.Clone(r.Context())
		out.RequestURI = ""
		out.Header.Del("Proxy-Authorization")
		resp, err := tr.RoundTrip(out)
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		defer func() { _ = resp.Body.Close() }()
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}))
	// A test kills an upstream by closing its server: its port stays held,
	// so a dial to it is refused rather than reaching another test's
	// server on a reused port.
	u.srv.Listener.Close()
	u.srv.Listener = testnet.Killable(t)
	u.srv.Start()
	t.Cleanup(u.srv.Close)
	t.Cleanup(tr.CloseIdleConnections)
	return u
}

func (u *upstream) addr() string { return u.srv.Listener.Addr().String() }

// recordingFleet is the server's Fleet: one pool "p", the pool's password,
// rules, and what the server reported.
type recordingFleet struct {
	user, password string
	rules          []ban.Rule
	mu             sync.Mutex
	suspects       []string
	banned         []ban.Verdict
}

func (f *recordingFleet) Known(pool string) bool { return pool == "p" }
func (f *recordingFleet) Credentials(route.Proxy) (string, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.user, f.password, nil
}

// setCredentials changes the pool's credentials, as a new sealed password
// would.
func (f *recordingFleet) setCredentials(user, password string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.user, f.password = user, password
}
func (f *recordingFleet) Rules(string) []ban.Rule { return f.rules }
func (f *recordingFleet) Suspect(id, _ string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.suspects = append(f.suspects, id)
}
func (f *recordingFleet) Banned(_ string, v ban.Verdict) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.banned = append(f.banned, v)
}

type harness struct {
	t     *testing.T
	table *route.Table
	fleet *recordingFleet
	srv   *Server
	gw    *httptest.Server
}

func newHarness(t *testing.T, fleet *recordingFleet, spec *events.GatewaySpec, ups ...*upstream) *harness {
	t.Helper()
	addrs := make([]string, len(ups))
	for i, u := range ups {
		addrs[i] = u.addr()
	}
	return newHarnessAt(t, fleet, spec, addrs...)
}

// newHarnessAt is newHarness for proxies at addrs, named p-a, p-b, ….
func newHarnessAt(t *testing.T, fleet *recordingFleet, spec *events.GatewaySpec, addrs ...string) *harness {
	t.Helper()
	h := &harness{t: t, table: route.NewTable(route.Limits{}, nil), fleet: fleet}
	h.table.SetSpec("p", spec)
	for i, a := range addrs {
		h.table.Set(route.Proxy{ID: "p-" + string(rune('a'+i)), Pool: "p", Address: a})
	}
	h.srv = New(Config{Table: h.table, Fleet: fleet, Auth: func(_, _, pw string) (bool, error) { return pw != "wrong", nil },
		DialTimeout: 2 * time.Second, ResponseTimeout: 10 * time.Second})
	h.gw = httptest.NewServer(h.srv)
	t.Cleanup(h.gw.Close)
	t.Cleanup(h.srv.Close)
	return h
}

// client returns an HTTP client using the gateway as its proxy with user.
func (h *harness) client(user string) *http.Client {
	u, _ := url.Parse(h.gw.URL)
	u.User = url.UserPassword(user, "x")
	tr := &http.Transport{Proxy: http.ProxyURL(u), TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	h.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

func origin(t *testing.T, h http.HandlerFunc) *httptest.Server {
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	return s
}

func get(t *testing.T, c *http.Client, u string) (int, string, http.Header) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

func TestRelaySpreadsAndNamesTheProxy(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Proxy-Authorization") != "" {
			t.Errorf("the origin got a Proxy-Authorization header")
		}
		_, _ = io.WriteString(w, "hello")
	})
	ups := []*upstream{newUpstream(t, "crawl:pw1"), newUpstream(t, "crawl:pw1"), newUpstream(t, "crawl:pw1")}
	h := newHarness(t, &recordingFleet{user: "crawl", password: "pw1"}, nil, ups...)
	c := h.client("p")
	seen := map[string]int{}
	for range 9 {
		code, body, hdr := get(t, c, site.URL+"/x")
		if code != 200 || body != "hello" {
			t.Fatalf("GET through the gateway: %d %q", code, body)
		}
		seen[hdr.Get(ProxyHeader)]++
	}
	if len(seen) != 3 || seen["p-a"] != 3 || seen["p-b"] != 3 || seen["p-c"] != 3 {
		t.Errorf("%s per proxy: %v; want 3 each of p-a, p-b, p-c (round-robin)", ProxyHeader, seen)
	}
	for _, u := range ups {
		u.mu.Lock()
		for _, a := range u.seenAuth {
			if a != "Basic "+base64.StdEncoding.EncodeToString([]byte("crawl:pw1")) {
				t.Errorf("upstream got Proxy-Authorization %q; want the pool's credentials, not the client's", a)
			}
		}
		u.mu.Unlock()
	}
	st := h.srv.Stats().Snapshot()["p"]
	if st.Requests != 9 || st.Errors != 0 || st.BytesDown != 45 || len(st.Proxies) != 3 {
		t.Errorf("stats of pool p: %+v; want 9 requests, 0 errors, 45 bytes down over 3 proxies", st)
	}
}

func TestSessionStaysOnOneProxyAndMovesWhenItLeaves(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	h := newHarness(t, &recordingFleet{}, nil, newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, ""))
	c := h.client("p.session-abc")
	var first string
	for i := range 10 {
		_, _, hdr := get(t, c, site.URL)
		if i == 0 {
			first = hdr.Get(ProxyHeader)
		} else if got := hdr.Get(ProxyHeader); got != first {
			t.Fatalf("request %d of session abc went through %s; the first went through %s", i, got, first)
		}
	}
	h.table.Remove(first)
	_, _, hdr := get(t, c, site.URL)
	moved := hdr.Get(ProxyHeader)
	if moved == first || moved == "" {
		t.Fatalf("after %s left, the session went through %q", first, moved)
	}
	for range 3 {
		if _, _, hdr := get(t, c, site.URL); hdr.Get(ProxyHeader) != moved {
			t.Fatalf("the moved session left %s for %s", moved, hdr.Get(ProxyHeader))
		}
	}
}

func TestFailoverOnADeadProxy(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	dead := newUpstream(t, "")
	h := newHarness(t, &recordingFleet{}, nil, dead, newUpstream(t, ""))
	dead.srv.Close() // p-a refuses connections from now on
	c := h.client("p")
	for i := range 6 {
		code, body, hdr := get(t, c, site.URL)
		if code != 200 || body != "ok" || hdr.Get(ProxyHeader) != "p-b" {
			t.Fatalf("request %d: %d %q via %q; want 200 ok via p-b", i, code, body, hdr.Get(ProxyHeader))
		}
	}
	h.fleet.mu.Lock()
	defer h.fleet.mu.Unlock()
	// After its first failure p-a cools: later requests go to p-b at
	// once, and p-a is reported once.
	if len(h.fleet.suspects) != 1 || h.fleet.suspects[0] != "p-a" {
		t.Errorf("suspects reported: %v; want p-a once", h.fleet.suspects)
	}
	if st := h.srv.Stats().Snapshot()["p"]; st.Proxies["p-a"].Errors != 1 {
		t.Errorf("failed attempts at p-a: %d; want 1 (it cools after the first)", st.Proxies["p-a"].Errors)
	}
}

func TestFailoverOnProxyStatusIsBounded(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	ups := []*upstream{newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, "")}
	for _, u := range ups[:3] {
		u.status.Store(http.StatusServiceUnavailable)
	}
	// retries 1: two attempts at most, and round-robin starts at p-a and
	// goes on among the others: both attempts meet a 503.
	one := 1
	h := newHarness(t, &recordingFleet{}, &events.GatewaySpec{Retries: &one}, ups...)
	code, _, hdr := get(t, h.client("p"), site.URL)
	if code != http.StatusServiceUnavailable {
		t.Fatalf("with p-a and p-b answering 503 and one retry: %d via %s; want the second 503", code, hdr.Get(ProxyHeader))
	}
	if n := ups[0].requests.Load() + ups[1].requests.Load() + ups[2].requests.Load(); n != 2 || ups[3].requests.Load() != 0 {
		t.Errorf("attempts: at the three 503 proxies %d, at p-d %d; want 2 and 0", n, ups[3].requests.Load())
	}
	// The default (2 retries) reaches a good proxy from any start.
	h2 := newHarness(t, &recordingFleet{}, nil, ups[0], ups[1], ups[3])
	for i := range 6 {
		if code, _, _ := get(t, h2.client("p"), site.URL); code != 200 {
			t.Fatalf("request %d with two of three proxies answering 503: %d", i, code)
		}
	}
}

func TestASites5xxIsRelayedNotRetried(t *testing.T) {
	var hits atomic.Int32
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, "come back later")
	})
	h := newHarness(t, &recordingFleet{}, nil, newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, ""))
	code, body, _ := get(t, h.client("p"), site.URL)
	if code != 503 || body != "come back later" || hits.Load() != 1 {
		t.Errorf("a site answering 503: %d %q after %d requests to it; want its 503 relayed after one", code, body, hits.Load())
	}
	h.fleet.mu.Lock()
	defer h.fleet.mu.Unlock()
	if len(h.fleet.suspects) != 0 {
		t.Errorf("a site's 503 reported proxies %v to health", h.fleet.suspects)
	}
}

func TestBanRuleReportsOnceAtTheThreshold(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/limited") {
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		_, _ = io.WriteString(w, "please solve this CAPTCHA")
	})
	rules, err := ban.Compile([]events.BanRule{
		{Name: "too-many", Status: []int{429}, Threshold: 3},
		{Name: "captcha", Body: "(?i)captcha", Threshold: 2},
	})
	if err != nil {
		t.Fatal(err)
	}
	f := &recordingFleet{rules: rules}
	h := newHarness(t, f, nil, newUpstream(t, ""))
	c := h.client("p")
	for i := range 2 {
		if code, _, _ := get(t, c, site.URL+"/limited"); code != 429 {
			t.Fatalf("request %d: %d; want the origin's 429 relayed", i, code)
		}
	}
	f.mu.Lock()
	if len(f.banned) != 0 {
		t.Errorf("banned after 2 of 3: %v", f.banned)
	}
	f.mu.Unlock()
	get(t, c, site.URL+"/limited")
	get(t, c, site.URL+"/limited")
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.banned) != 1 || f.banned[0].Proxy != "p-a" || f.banned[0].Rule != "too-many" {
		t.Errorf("ban reports: %+v; want one, p-a by too-many", f.banned)
	}
	if st := h.srv.Stats().Snapshot()["p"]; st.Bans != 1 {
		t.Errorf("bans counted: %d; want 1", st.Bans)
	}
}

func TestBanRuleOnTheBodyStillRelaysIt(t *testing.T) {
	body := "<html>" + strings.Repeat("x", 100<<10) + " captcha</html>"
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/early" {
			_, _ = io.WriteString(w, "captcha"+body)
			return
		}
		_, _ = io.WriteString(w, body)
	})
	rules, _ := ban.Compile([]events.BanRule{{Name: "captcha", Body: "captcha", Threshold: 1}})
	f := &recordingFleet{rules: rules}
	h := newHarness(t, f, nil, newUpstream(t, ""))
	// The word past the first 64 KiB is not seen; the body arrives whole.
	if _, got, _ := get(t, h.client("p"), site.URL+"/late"); got != body {
		t.Fatalf("relayed body of %d bytes; want the %d the origin sent", len(got), len(body))
	}
	f.mu.Lock()
	n := len(f.banned)
	f.mu.Unlock()
	if n != 0 {
		t.Fatalf("a match past the first 64 KiB banned the proxy")
	}
	if _, got, _ := get(t, h.client("p"), site.URL+"/early"); got != "captcha"+body {
		t.Fatalf("relayed body of %d bytes; want %d", len(got), len("captcha"+body))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.banned) != 1 {
		t.Errorf("ban reports: %v; want one", f.banned)
	}
}

func TestConnectTunnelWithFailover(t *testing.T) {
	site := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "secure") }))
	t.Cleanup(site.Close)
	dead := newUpstream(t, "crawl:pw")
	h := newHarness(t, &recordingFleet{user: "crawl", password: "pw"}, nil, dead, newUpstream(t, "crawl:pw"))
	dead.srv.Close()
	c := h.client("p")
	for i := range 4 {
		code, body, _ := get(t, c, site.URL)
		if code != 200 || body != "secure" {
			t.Fatalf("HTTPS request %d through a CONNECT tunnel: %d %q", i, code, body)
		}
		c.Transport.(*http.Transport).CloseIdleConnections() // a new tunnel each time
	}
	// A tunnel is counted when it closes, after the client saw its end.
	var st PoolSnapshot
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if st = h.srv.Stats().Snapshot()["p"]; st.Proxies["p-b"].Requests == 4 {
			break
		}
	}
	if st.Proxies["p-b"].Requests != 4 || st.Proxies["p-b"].BytesDown == 0 || st.Proxies["p-b"].BytesUp == 0 {
		t.Errorf("p-b carried %+v; want 4 tunnels with bytes both ways", st.Proxies["p-b"])
	}
}

func TestConnectRefusedByTheProxyIsRelayed(t *testing.T) {
	u := newUpstream(t, "")
	u.status.Store(http.StatusForbidden)
	h := newHarness(t, &recordingFleet{}, nil, u)
	conn, err := net.Dial("tcp", h.gw.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	auth := base64.StdEncoding.EncodeToString([]byte("p:x"))
	_, _ = io.WriteString(conn, "CONNECT example.test:443 HTTP/1.1\r\nHost: example.test:443\r\nProxy-Authorization: Basic "+auth+"\r\n\r\n")
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 512)
	n, _ := conn.Read(b)
	if !strings.HasPrefix(string(b[:n]), "HTTP/1.1 403") {
		t.Errorf("answer to CONNECT when the proxy refuses with 403: %q", b[:n])
	}
}

func TestClientsAreAuthenticated(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	h := newHarness(t, &recordingFleet{}, nil, newUpstream(t, ""))
	plain := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(mustURL(h.gw.URL))}}
	for _, c := range []struct {
		name   string
		client *http.Client
		code   int
		says   string
	}{
		{"no credentials", plain, 407, "proxy authentication required"},
		{"bad username", h.client("p.x"), 407, "is neither <label>-<value> nor session-<id> (username is " + route.UserGrammar},
		{"label twice", h.client("p.region-eu.region-us"), 407, "label region is selected twice"},
		{"session before a label", h.client("p.session-s1.region-eu"), 407, "the session comes last"},
		{"bad label name", h.client("p.Region-eu"), 407, `the label name "Region"`},
		{"bad session", h.client("p.session-a/b"), 407, "session id"},
		{"unknown pool", h.client("q"), 404, `no pool named "q"`},
	} {
		code, body, hdr := get(t, c.client, site.URL)
		if code != c.code || !strings.Contains(body, c.says) {
			t.Errorf("%s: %d %q; want %d saying %q", c.name, code, body, c.code, c.says)
		}
		if code == 407 && hdr.Get("Proxy-Authenticate") == "" {
			t.Errorf("%s: 407 without Proxy-Authenticate", c.name)
		}
	}
	u := mustURL(h.gw.URL)
	u.User = url.UserPassword("p", "wrong")
	wrong := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(u)}}
	if code, body, _ := get(t, wrong, site.URL); code != 407 || !strings.Contains(body, "wrong password") {
		t.Errorf("wrong password: %d %q", code, body)
	}
	resp, err := http.Get(h.gw.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Errorf("origin-form request to the gateway: %d; want 400", resp.StatusCode)
	}
}

func TestNoReadyProxy(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	h := newHarness(t, &recordingFleet{}, nil)
	if code, body, _ := get(t, h.client("p"), site.URL); code != 503 || !strings.Contains(body, "no ready proxy") {
		t.Errorf("pool without ready proxies: %d %q; want 503 saying so", code, body)
	}
}

func TestDemandCountsPeakConnections(t *testing.T) {
	release := make(chan struct{})
	var arrived sync.WaitGroup
	arrived.Add(5)
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		arrived.Done()
		<-release
		_, _ = io.WriteString(w, "ok")
	})
	h := newHarness(t, &recordingFleet{}, nil, newUpstream(t, ""), newUpstream(t, ""))
	var done sync.WaitGroup
	for range 5 {
		done.Add(1)
		go func() {
			defer done.Done()
			resp, err := h.client("p").Get(site.URL)
			if err == nil {
				_ = resp.Body.Close()
			}
		}()
	}
	arrived.Wait()
	if d := h.srv.Stats().TakeDemand()["p"]; d.Peak != 5 || d.Requests != 5 {
		t.Errorf("demand with 5 requests open: %+v; want peak 5, 5 requests", d)
	}
	close(release)
	done.Wait()
	if d := h.srv.Stats().TakeDemand()["p"]; d.Peak != 5 || d.Requests != 0 {
		t.Errorf("demand of the period they ended in: %+v; want peak 5 (they were open at its start), 0 new", d)
	}
	if d := h.srv.Stats().TakeDemand()["p"]; d.Peak != 0 {
		t.Errorf("demand of an idle period: %+v; want peak 0", d)
	}
}

func mustURL(s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		panic(err)
	}
	return u
}

func TestOwnLimitIsNotTheProxysFault(t *testing.T) {
	wrap := func(errno syscall.Errno) error {
		return &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", errno)}
	}
	for errno, want := range map[syscall.Errno]bool{
		syscall.EMFILE: true, syscall.ENFILE: true, syscall.EADDRNOTAVAIL: true,
		syscall.ECONNREFUSED: false, syscall.ETIMEDOUT: false, syscall.EHOSTUNREACH: false,
	} {
		if got := ownLimit(wrap(errno)); got != want {
			t.Errorf("ownLimit(%v) = %v; want %v", errno, got, want)
		}
	}
}
