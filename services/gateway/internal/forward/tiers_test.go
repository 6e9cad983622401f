package forward

import (
	"bufio"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/bantest"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
)

// poolsFleet is a recordingFleet that knows several pools.
type poolsFleet struct {
	*recordingFleet
	pools []string
}

func (f *poolsFleet) Known(pool string) bool { return slices.Contains(f.pools, pool) }

// testClock is a clock the test moves.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// poolsHarness is a gateway in front of table, whose pools are those of
// specs, with the clock now (nil: time.Now) and the request log logger
// (nil: none).
func poolsHarness(t *testing.T, table *route.Table, specs map[string]*events.GatewaySpec, rules []events.BanRule, now func() time.Time, logger *reqlog.Logger) *harness {
	t.Helper()
	compiled, err := ban.Compile(rules)
	if err != nil {
		t.Fatal(err)
	}
	rf := &recordingFleet{rules: compiled}
	f := &poolsFleet{recordingFleet: rf}
	for name, spec := range specs {
		f.pools = append(f.pools, name)
		table.SetSpec(name, spec)
	}
	h := &harness{t: t, table: table, fleet: rf}
	h.srv = New(Config{Table: table, Fleet: f, Auth: func(_, _, pw string) (bool, error) { return pw != "wrong", nil },
		DialTimeout: 2 * time.Second, ResponseTimeout: 10 * time.Second, Now: now, RequestLog: logger})
	h.gw = httptest.NewServer(h.srv)
	t.Cleanup(h.gw.Close)
	t.Cleanup(h.srv.Close)
	return h
}

// TestLabelsSelectTheProxies: requests selecting region-eu all go through
// the pool's eu proxies, spread over them; a selection no proxy carries
// is answered 503 naming the labels, without an attempt.
func TestLabelsSelectTheProxies(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hello") })
	table := route.NewTable(route.Limits{}, nil)
	ups := map[string]*upstream{}
	for _, id := range []string{"p-eu-0", "p-eu-1", "p-eu-2", "p-us-0", "p-us-1"} {
		ups[id] = newUpstream(t, "")
		region := strings.Split(id, "-")[1]
		table.Set(route.Proxy{ID: id, Pool: "p", Address: ups[id].addr(), Labels: map[string]string{"region": region, "provider": "local"}})
	}
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{"p": nil}, nil, nil, nil)
	c := h.client("p.region-eu")
	for i := range 30 {
		code, body, hdr := get(t, c, site.URL+"/")
		if code != 200 || body != "hello" || !strings.HasPrefix(hdr.Get(ProxyHeader), "p-eu-") || hdr.Get(PoolHeader) != "p" {
			t.Fatalf("request %d as p.region-eu: %d %q through %q of pool %q; want hello through an eu proxy of p", i, code, body, hdr.Get(ProxyHeader), hdr.Get(PoolHeader))
		}
	}
	for id, u := range ups {
		want := int32(10)
		if strings.HasPrefix(id, "p-us-") {
			want = 0
		}
		if n := u.requests.Load(); n != want {
			t.Errorf("%s carried %d requests; want %d", id, n, want)
		}
	}
	for user, want := range map[string]string{
		"p.region-mars":                `no ready proxy of pool "p" has region=mars`,
		"p.region-eu.provider-aws":     `no ready proxy of pool "p" has provider=aws and region=eu`,
		"p.region-mars.session-s1":     `no ready proxy of pool "p" has region=mars`,
		"p.country-de.region-eu.x-1.y": "", // malformed: 407 below
	} {
		code, body, hdr := get(t, h.client(user), site.URL+"/")
		if want == "" {
			if code != http.StatusProxyAuthRequired || !strings.Contains(body, route.UserGrammar) {
				t.Errorf("%s: %d %q; want 407 quoting the grammar", user, code, body)
			}
			continue
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, want) || hdr.Get(AttemptsHeader) != "0" {
			t.Errorf("%s: %d %q after %s attempts; want 503 saying %q after 0", user, code, body, hdr.Get(AttemptsHeader), want)
		}
	}
}

// TestSessionWithASelectionFailsOverWithinIt: a session selecting
// region-eu whose proxy dies moves to another eu proxy, never a us one,
// and stays there.
func TestSessionWithASelectionFailsOverWithinIt(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hello") })
	table := route.NewTable(route.Limits{}, nil)
	ups := map[string]*upstream{}
	for _, id := range []string{"p-eu-0", "p-eu-1", "p-us-0", "p-us-1", "p-us-2"} {
		ups[id] = newUpstream(t, "")
		table.Set(route.Proxy{ID: id, Pool: "p", Address: ups[id].addr(), Labels: map[string]string{"region": strings.Split(id, "-")[1]}})
	}
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{"p": nil}, nil, nil, nil)
	c := h.client("p.region-eu.session-s1")
	_, _, hdr := get(t, c, site.URL)
	first := hdr.Get(ProxyHeader)
	if !strings.HasPrefix(first, "p-eu-") {
		t.Fatalf("the session's first request went through %q; want an eu proxy", first)
	}
	ups[first].srv.Close()
	code, _, hdr := get(t, c, site.URL)
	moved := hdr.Get(ProxyHeader)
	if code != 200 || !strings.HasPrefix(moved, "p-eu-") || moved == first || hdr.Get(AttemptsHeader) != "2" {
		t.Fatalf("after %s died: %d through %q after %s attempts; want 200 through the other eu proxy after 2", first, code, moved, hdr.Get(AttemptsHeader))
	}
	for i := range 5 {
		if _, _, hdr := get(t, c, site.URL); hdr.Get(ProxyHeader) != moved || hdr.Get(AttemptsHeader) != "1" {
			t.Errorf("request %d after the move: through %q after %s attempts; want %s after 1", i, hdr.Get(ProxyHeader), hdr.Get(AttemptsHeader), moved)
		}
	}
	// The same session id without a selection is another session, which
	// any proxy may serve.
	if code, _, _ := get(t, h.client("p.session-s1"), site.URL); code != 200 {
		t.Errorf("the session id without a selection: %d", code)
	}
	for _, id := range []string{"p-us-0", "p-us-1", "p-us-2"} {
		if n := ups[id].requests.Load(); n > 1 {
			t.Errorf("%s carried %d requests; want at most the one of the session without a selection", id, n)
		}
	}
}

// TestBannedSiteFallsBackToTheNextPool: a site bans every proxy of the
// cheap pool; its pages come through the premium pool, named by
// X-Proxyfleet-Pool and the request log's tier, and the site's next
// requests start at premium (cheap's proxies are not tried) until
// cheap's tierMemory passes. Other sites keep starting at cheap.
func TestBannedSiteFallsBackToTheNextPool(t *testing.T) {
	banning := bantest.NewSite(t, "127.0.0.10", fromA, fromB)
	other := bantest.NewSite(t, "127.0.0.11")
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "cheap-a", Pool: "cheap", Address: bantest.Proxy(t, fromA)})
	table.Set(route.Proxy{ID: "cheap-b", Pool: "cheap", Address: bantest.Proxy(t, fromB)})
	table.Set(route.Proxy{ID: "premium-a", Pool: "premium", Address: bantest.Proxy(t, fromC)})
	clock := &testClock{now: time.Unix(1_000_000, 0)}
	got, logger, ctx := startRequestLog(t)
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{
		"cheap":   {Fallback: []string{"premium"}, TierMemory: events.Duration(time.Minute)},
		"premium": nil,
	}, []events.BanRule{blocked}, clock.Now, logger)
	c := h.client("cheap")

	code, body, hdr := get(t, c, banning.URL+"/")
	if code != 200 || body != "hello" || hdr.Get(PoolHeader) != "premium" || hdr.Get(ProxyHeader) != "premium-a" || attemptsOf(t, hdr) != 3 {
		t.Fatalf("first request: %d %q through %q of pool %q after %s attempts; want hello through premium-a of premium after 3 (both cheap proxies banned)",
			code, body, hdr.Get(ProxyHeader), hdr.Get(PoolHeader), hdr.Get(AttemptsHeader))
	}
	select {
	case r := <-got:
		if r.Pool != "cheap" || r.Tier != "premium" || strings.Join(r.Proxies, ",") != "cheap-a,cheap-b,premium-a" || r.Status != 200 || r.Ban != "blocked" && r.Ban != "" {
			t.Errorf("record %+v; want pool cheap, tier premium, proxies cheap-a,cheap-b,premium-a, 200", r)
		}
	case <-ctx.Done():
		t.Fatal("no request log record")
	}
	for i := range 4 {
		clock.add(10 * time.Second)
		code, body, hdr := get(t, c, banning.URL+"/")
		if code != 200 || body != "hello" || hdr.Get(PoolHeader) != "premium" || attemptsOf(t, hdr) != 1 {
			t.Errorf("request %d within tierMemory: %d %q of pool %q after %s attempts; want hello of premium after 1", i, code, body, hdr.Get(PoolHeader), hdr.Get(AttemptsHeader))
		}
	}
	if a, b := banning.Seen(fromA), banning.Seen(fromB); a != 1 || b != 1 {
		t.Errorf("the banning site saw cheap-a %d and cheap-b %d times; want once each (later requests start at premium)", a, b)
	}
	if tiers := h.srv.Tiers(); len(tiers) != 1 || tiers[0].Pool != "cheap" || tiers[0].Site != "127.0.0.10" || tiers[0].Tier != "premium" || tiers[0].Labels != "" {
		t.Errorf("tiers %+v; want the banning site at premium for cheap", tiers)
	}
	if _, _, hdr := get(t, c, other.URL+"/"); hdr.Get(PoolHeader) != "cheap" || attemptsOf(t, hdr) != 1 {
		t.Errorf("another site: pool %q after %s attempts; want cheap after 1", hdr.Get(PoolHeader), hdr.Get(AttemptsHeader))
	}

	clock.add(21 * time.Second) // 61s since the fallback was needed
	code, _, hdr = get(t, c, banning.URL+"/")
	if code != 200 || hdr.Get(PoolHeader) != "premium" || attemptsOf(t, hdr) != 3 {
		t.Errorf("after tierMemory: %d of pool %q after %s attempts; want cheap tried again (3 attempts), served by premium", code, hdr.Get(PoolHeader), hdr.Get(AttemptsHeader))
	}
	if tiers := h.srv.Tiers(); len(tiers) != 1 || !tiers[0].Until.Equal(clock.Now().Add(time.Minute)) {
		t.Errorf("tiers %+v; want the site remembered afresh for a minute", tiers)
	}
	if a := banning.Seen(fromA); a != 2 {
		t.Errorf("the banning site saw cheap-a %d times; want twice (tried again after tierMemory)", a)
	}
}

// TestFallbackCycleIsGuarded: pools that fall back to each other are each
// visited once per request; the last ban page is delivered when both are
// banned.
func TestFallbackCycleIsGuarded(t *testing.T) {
	banning := bantest.NewSite(t, "127.0.0.10", fromA, fromB)
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "a-a", Pool: "a", Address: bantest.Proxy(t, fromA)})
	table.Set(route.Proxy{ID: "b-a", Pool: "b", Address: bantest.Proxy(t, fromB)})
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{
		"a": {Fallback: []string{"b"}},
		"b": {Fallback: []string{"a", "c"}},
		"c": {Fallback: []string{"b", "a", "gone"}},
	}, []events.BanRule{blocked}, nil, nil)
	for pool, want := range map[string][]string{"a": {"a", "b", "c"}, "b": {"b", "a", "c"}, "c": {"c", "b", "a"}} {
		if got := h.srv.chain(pool); !slices.Equal(got, want) {
			t.Errorf("chain of %s: %q; want %q", pool, got, want)
		}
	}
	code, body, hdr := get(t, h.client("a"), banning.URL+"/")
	if code != 403 || strings.TrimSpace(body) != bantest.BanPage || hdr.Get(BannedHeader) != "blocked" || hdr.Get(PoolHeader) != "b" || attemptsOf(t, hdr) != 2 {
		t.Errorf("both pools banned: %d %q, %s %q, pool %q after %s attempts; want b's ban page, blocked, after 2",
			code, body, BannedHeader, hdr.Get(BannedHeader), hdr.Get(PoolHeader), hdr.Get(AttemptsHeader))
	}
	if a, b := banning.Seen(fromA), banning.Seen(fromB); a != 1 || b != 1 {
		t.Errorf("the site saw a-a %d and b-a %d times; want once each", a, b)
	}
}

// TestFallbackWithoutProxies: a pool without a ready proxy, or without
// one carrying the selected labels, falls back to the next pool; a
// selection no tier can serve is answered 503.
func TestFallbackWithoutProxies(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hello") })
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "first-us", Pool: "first", Address: newUpstream(t, "").addr(), Labels: map[string]string{"region": "us"}})
	table.Set(route.Proxy{ID: "second-eu", Pool: "second", Address: newUpstream(t, "").addr(), Labels: map[string]string{"region": "eu"}})
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{
		"empty":  {Fallback: []string{"first"}},
		"first":  {Fallback: []string{"second"}},
		"second": nil,
	}, nil, nil, nil)
	for user, want := range map[string]string{"empty": "first", "first.region-eu": "second", "first.region-us": "first", "empty.region-eu": "second"} {
		code, _, hdr := get(t, h.client(user), site.URL)
		if code != 200 || hdr.Get(PoolHeader) != want {
			t.Errorf("%s: %d from pool %q; want 200 from %s", user, code, hdr.Get(PoolHeader), want)
		}
	}
	code, body, _ := get(t, h.client("first.region-mars"), site.URL)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, `no ready proxy of pool "second" has region=mars`) {
		t.Errorf("a selection no tier serves: %d %q; want 503 naming the last pool and the label", code, body)
	}
}

// TestTunnelFallsBackWhenNoProxyOpensIt: an opaque CONNECT whose pool's
// proxies cannot be reached opens through the fallback pool, whose pool
// the 200 names.
func TestTunnelFallsBackWhenNoProxyOpensIt(t *testing.T) {
	tlsSite := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "secure") }))
	t.Cleanup(tlsSite.Close)
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "p-dead", Pool: "p", Address: testnet.Refusing(t).String()})
	table.Set(route.Proxy{ID: "q-a", Pool: "q", Address: newUpstream(t, "").addr()})
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{"p": {Fallback: []string{"q"}}, "q": nil}, nil, nil, nil)
	host := tlsSite.Listener.Addr().String()
	conn, err := net.Dial("tcp", h.gw.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_, _ = io.WriteString(conn, "CONNECT "+host+" HTTP/1.1\r\nHost: "+host+"\r\nProxy-Authorization: Basic cDp4\r\n\r\n") // p:x
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get(PoolHeader) != "q" || resp.Header.Get(ProxyHeader) != "q-a" {
		t.Fatalf("CONNECT: %s through %q of pool %q; want 200 through q-a of q", resp.Status, resp.Header.Get(ProxyHeader), resp.Header.Get(PoolHeader))
	}
	tc := tls.Client(&bufferedConn{Conn: conn, r: br}, &tls.Config{InsecureSkipVerify: true})
	_, _ = io.WriteString(tc, "GET / HTTP/1.1\r\nHost: "+host+"\r\nConnection: close\r\n\r\n")
	got, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(got.Body)
	if string(b) != "secure" {
		t.Errorf("through the tunnel: %q; want secure", b)
	}
}

// TestInterceptedRequestFallsBack: an HTTPS request inside an
// intercepted connection goes on to the fallback pool when its pool's
// proxy cannot be reached, as a plain HTTP request does.
func TestInterceptedRequestFallsBack(t *testing.T) {
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "secure") })
	table := route.NewTable(route.Limits{}, nil)
	table.SetSpec("p", &events.GatewaySpec{Intercept: true, Fallback: []string{"q"}})
	table.Set(route.Proxy{ID: "p-dead", Pool: "p", Address: testnet.Refusing(t).String()})
	table.Set(route.Proxy{ID: "q-a", Pool: "q", Address: newUpstream(t, "").addr()})
	rf := &recordingFleet{}
	h := &interceptHarness{harness: &harness{t: t, table: table, fleet: rf}}
	h.srv = New(Config{Table: table, Fleet: &poolsFleet{recordingFleet: rf, pools: []string{"p", "q"}}, Auth: func(_, _, _ string) (bool, error) { return true, nil },
		DialTimeout: 2 * time.Second, ResponseTimeout: 10 * time.Second, CA: gwCA, OriginRoots: originCA.pool})
	h.gw = httptest.NewServer(h.srv)
	t.Cleanup(h.gw.Close)
	t.Cleanup(h.srv.Close)
	code, body, hdr := get(t, h.trusting("p", gwCA.pool), site.URL+"/")
	if code != 200 || body != "secure" || hdr.Get(PoolHeader) != "q" || hdr.Get(ProxyHeader) != "q-a" || attemptsOf(t, hdr) != 2 {
		t.Errorf("intercepted request: %d %q through %q of pool %q after %s attempts; want secure through q-a of q after 2",
			code, body, hdr.Get(ProxyHeader), hdr.Get(PoolHeader), hdr.Get(AttemptsHeader))
	}
}

// TestPerSiteLimitFallsBack: a request that finds every proxy of its pool
// at its per-site limit past queueTimeout goes on to the fallback pool
// instead of being answered 429.
func TestPerSiteLimitFallsBack(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		_, _ = io.WriteString(w, "hello")
	})
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "p-a", Pool: "p", Address: newUpstream(t, "").addr()})
	table.Set(route.Proxy{ID: "q-a", Pool: "q", Address: newUpstream(t, "").addr()})
	h := poolsHarness(t, table, map[string]*events.GatewaySpec{
		"p": {Fallback: []string{"q"}, PerSite: &events.PerSite{Concurrency: 1, QueueTimeout: events.Duration(200 * time.Millisecond)}},
		"q": nil,
	}, nil, nil, nil)
	slow := make(chan string, 1)
	go func() {
		resp, err := h.client("p").Get(site.URL + "/slow")
		if err != nil {
			slow <- err.Error()
			return
		}
		_ = resp.Body.Close()
		slow <- resp.Header.Get(PoolHeader)
	}()
	// The slow request holds p-a's one place at the site.
	testwait.Until(t, 10*time.Second, "the slow request to hold p-a", func() bool { return table.Open("p")["p-a"] == 1 })
	code, _, hdr := get(t, h.client("p"), site.URL+"/fast")
	if code != 200 || hdr.Get(PoolHeader) != "q" {
		t.Errorf("with p-a at its limit: %d from pool %q; want 200 from q", code, hdr.Get(PoolHeader))
	}
	once.Do(func() { close(release) })
	if got := <-slow; got != "p" {
		t.Errorf("the slow request: %q; want served by p", got)
	}
}
