package e2e_test

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
)

// gatewayServing finds the gateway's client address in its log.
var gatewayServing = regexp.MustCompile(`"msg":"gateway serving"[^\n]*?"listen":"([^"]+)"`)

// gatewayNamed finds the gateway's name in its serving line.
var gatewayNamed = regexp.MustCompile(`"msg":"gateway serving"[^\n]*?"name":"([^"]+)"`)

// startGateway starts the gateway on a port from the kernel and returns
// its address once it serves.
func (f *fleet) startGateway(args ...string) string {
	f.t.Helper()
	f.start("gateway", append([]string{"--listen", "127.0.0.1:0", "--demand-interval", "1s"}, args...)...)
	var addr string
	waitFor(f.t, 60*time.Second, "the gateway to serve", func() bool {
		m := gatewayServing.FindStringSubmatch(f.log("gateway"))
		if m == nil {
			return false
		}
		addr = m[1]
		return true
	})
	return addr
}

// gatewayClient is an HTTP client using the gateway at addr as its proxy
// with username user.
func gatewayClient(t *testing.T, addr, user string) *http.Client {
	tr := &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: addr, User: url.UserPassword(user, "x")}),
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, // the local TLS origin's own certificate
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// viaGateway GETs target with c and returns the status, the body and the
// proxy the gateway named.
func viaGateway(c *http.Client, target string) (int, string, string, error) {
	resp, err := c.Get(target)
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header.Get("X-Proxyfleet-Proxy"), err
}

// TestGatewayUnderMakeRun is the acceptance under make run: with a
// pool demo of 3, the banner's curl through the gateway succeeds 30 times
// over all 3 proxies, a session stays on one proxy for 10 requests,
// HTTPS goes through a CONNECT tunnel, and the banner's labelled example
// works.
func TestGatewayUnderMakeRun(t *testing.T) {
	testgate.NeedBinary(t, "curl", "the banner's commands use it (apt-get install curl)")
	site := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "secure page") }))
	t.Cleanup(site.Close)
	r := startRunScript(t,
		"PLANNER_FLAGS=--reconcile-interval 200ms",
		"HEALTH_FLAGS=--probe-interval 300ms --probe-timeout 2s",
		"AGENT_FLAGS=--target t1 --capacity 6 --egress-allow "+site.Listener.Addr().String(),
	)
	banner := r.waitBanner()
	env := bannerLine(t, banner, ". ")
	apply := bannerLine(t, banner, `nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":3}'`)
	if out, err := r.shell(env + " && " + apply); err != nil {
		t.Fatalf("%s: %v\n%s", apply, err, out)
	}
	curl := bannerLine(t, banner, "curl -x http://demo:x@")
	session := bannerLine(t, banner, "curl -x http://demo.session-abc:x@")
	gateway := regexp.MustCompile(`@(127\.0\.0\.1:\d+)`).FindStringSubmatch(curl)[1]

	// The gateway routes to the proxies health finds ready.
	waitFor(t, 90*time.Second, "the gateway to route over 3 ready proxies", func() bool {
		out, err := r.shell(strings.Repeat(curl+" -s | grep -i '^x-proxyfleet-proxy'; ", 6))
		return err == nil && len(distinct(out)) == 3
	})
	out, err := r.shell("for i in $(seq 1 30); do " + curl + " -s -f | grep -i '^x-proxyfleet-proxy' || echo FAILED; done")
	if err != nil || strings.Contains(out, "FAILED") || strings.Count(out, "\n") != 30 {
		t.Fatalf("30 × %s: %v\n%s", curl, err, out)
	}
	if d := distinct(out); len(d) != 3 {
		t.Errorf("30 requests through the gateway named %d proxies (%v); want the pool's 3", len(d), d)
	}
	out, err = r.shell("for i in $(seq 1 10); do " + session + " -s -f | grep -i '^x-proxyfleet-proxy' || echo FAILED; done")
	if err != nil || strings.Contains(out, "FAILED") || strings.Count(out, "\n") != 10 {
		t.Fatalf("10 × %s: %v\n%s", session, err, out)
	}
	if d := distinct(out); len(d) != 1 {
		t.Errorf("10 requests of session abc named %v; want one proxy", d)
	}

	// Each request left a record in the request log (docs/gateway.md),
	// the session's with its id.
	waitFor(t, 10*time.Second, "the session's records in the request log", func() bool {
		b, _ := os.ReadFile(filepath.Join(r.runDir, "logs", "gateway.log"))
		name := gatewayNamed.FindSubmatch(b)
		if name == nil {
			return false
		}
		out, err := r.shell(env + " && nats stream get FLEET_GATEWAY_LOG -S fleet.gateway.log." + string(name[1]))
		return err == nil && strings.Contains(out, `"pool":"demo"`) && strings.Contains(out, `"session":"abc"`) && !strings.Contains(out, "x@")
	})

	// HTTPS: the client tunnels through the gateway with CONNECT.
	code, body, _, err := viaGateway(gatewayClient(t, gateway, "demo"), site.URL+"/")
	if err != nil || code != 200 || body != "secure page" {
		t.Errorf("HTTPS through the gateway: %d %q %v", code, body, err)
	}

	// The banner's labelled example: a pool placed by the target's
	// label, and a request selecting it.
	labelledExample(t, r, banner, env)
}

// distinct returns the distinct X-Proxyfleet-Proxy values in curl's
// header lines.
func distinct(out string) map[string]int {
	d := map[string]int{}
	for _, l := range strings.Split(out, "\n") {
		if _, v, ok := strings.Cut(l, ":"); ok {
			d[strings.TrimSpace(v)]++
		}
	}
	return d
}

// TestGatewayNoRequestFailsWhenAProxyDies is kill -9 of one proxy process
// while a client loops requests through the gateway: no request fails
// (the gateway retries on another proxy and reports the dead one to
// health), and the pool heals.
func TestGatewayNoRequestFailsWhenAProxyDies(t *testing.T) {
	f := startFleet(t)
	gw := f.startGateway()
	f.apply(events.PoolSpec{Name: "gw", Provider: "local", Size: 3})
	ready := f.waitPool("gw", 3, "ready", 60*time.Second)
	echo := "http://" + f.echoEndpoint() + "/"
	c := gatewayClient(t, gw, "gw")
	waitFor(t, 30*time.Second, "the gateway to route to all 3", func() bool {
		seen := map[string]bool{}
		for range 6 {
			if _, _, via, err := viaGateway(c, echo); err == nil {
				seen[via] = true
			}
		}
		return len(seen) == 3
	})

	var ok, failed atomic.Int64
	var firstErr atomic.Value
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				code, _, _, err := viaGateway(c, echo)
				if err == nil && code == 200 {
					ok.Add(1)
					continue
				}
				failed.Add(1)
				firstErr.CompareAndSwap(nil, fmt.Sprintf("%d %v", code, err))
			}
		}()
	}
	victim := ready[0]
	if err := syscall.Kill(f.statePID(victim.ID), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	atKill := ok.Load()
	waitFor(t, 90*time.Second, "3 ready proxies without the killed one", func() bool {
		n := 0
		for _, p := range f.proxies("gw") {
			if p.ID == victim.ID {
				return false
			}
			if p.State == "ready" {
				n++
			}
		}
		return n == 3
	})
	close(stop)
	wg.Wait()
	if n := failed.Load(); n != 0 {
		t.Errorf("%d requests failed through the gateway after kill -9 of %s (first: %v); want none", n, victim.ID, firstErr.Load())
	}
	if after := ok.Load() - atKill; after < 20 {
		t.Errorf("only %d requests completed between the kill and the pool's heal; the loop did not exercise the gateway", after)
	}
	t.Logf("%d requests completed, %d failed, while %s died and was replaced", ok.Load(), failed.Load(), victim.ID)
	if !strings.Contains(f.log("gateway"), `"proxy":"`+victim.ID+`"`) {
		t.Errorf("the gateway's log never names the dead proxy %s: it did not fail over from it", victim.ID)
	}
}

// limitedSite is a local origin answering 429 on /limited and 200
// elsewhere.
func limitedSite(t *testing.T) *httptest.Server {
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/limited" {
			w.WriteHeader(http.StatusTooManyRequests)
			io.WriteString(w, "slow down")
			return
		}
		io.WriteString(w, "fine")
	}))
	t.Cleanup(site.Close)
	return site
}

// TestGatewayBanRuleRetiresAndReplaces is a local origin answering 429
// on a path: past the pool's rule's threshold, the gateway reports the
// proxy and the planner retires it with reason "banned: <rule>" and
// replaces it. (The pool retries nothing, so the ban pages reach the
// client; TestGatewayHTTPSCrawl has them retried.)
func TestGatewayBanRuleRetiresAndReplaces(t *testing.T) {
	site := limitedSite(t)
	f := startFleet(t, site)
	gw := f.startGateway()
	// No retries: a ban page is otherwise retried on the other proxy,
	// which the site answers 429 too, and both would be reported.
	noRetries := 0
	f.apply(events.PoolSpec{Name: "bans", Provider: "local", Size: 2,
		Gateway: &events.GatewaySpec{Retries: &noRetries, BanRules: []events.BanRule{{Name: "too-many", Status: []int{429}, Threshold: 3, Window: events.Duration(time.Minute)}}}})
	f.waitPool("bans", 2, "ready", 60*time.Second)
	// One session: every request goes through the same proxy.
	c := gatewayClient(t, gw, "bans.session-crawl1")
	var victim string
	waitFor(t, 30*time.Second, "a request through the gateway", func() bool {
		code, _, via, err := viaGateway(c, site.URL+"/")
		victim = via
		return err == nil && code == 200 && via != ""
	})
	for i := range 3 {
		code, body, via, err := viaGateway(c, site.URL+"/limited")
		if err != nil || code != 429 || via != victim {
			t.Fatalf("request %d to /limited: %d %q via %s, %v; want the origin's 429 via %s", i, code, body, via, err, victim)
		}
	}
	retiring := events.EventSubject(events.AggregateProxy, victim, events.ProxyRetiring)
	waitFor(t, 30*time.Second, "the banned proxy's retiring event", func() bool { return f.eventCount(retiring) > 0 })
	var rd events.ProxyRetiringData
	env, err := events.DecodeEnvelope(lastEventOf(t, f, retiring).Data)
	if err != nil || env.DecodeData(&rd) != nil {
		t.Fatalf("retiring event: %v", err)
	}
	if rd.Reason != "banned: too-many" {
		t.Errorf("retiring reason %q; want %q", rd.Reason, "banned: too-many")
	}
	waitFor(t, 60*time.Second, "2 ready proxies without the banned one", func() bool {
		n := 0
		for _, p := range f.proxies("bans") {
			if p.ID == victim {
				return false
			}
			if p.State == "ready" {
				n++
			}
		}
		return n == 2
	})
	// The session moved to a proxy still in the pool.
	waitFor(t, 30*time.Second, "the session on another proxy", func() bool {
		code, _, via, err := viaGateway(c, site.URL+"/")
		return err == nil && code == 200 && via != victim && via != ""
	})
}

// TestGatewayAutoscale is demand-driven sizing end to end: 40 slow
// connections through the gateway against a pool with autoscale {min 2,
// max 10, targetConnections 4} grow it to 10 ready proxies; once the load
// stops, it returns to 2 after scaleDownAfter; every step is a
// pool.scaled event with its reason.
func TestGatewayAutoscale(t *testing.T) {
	release := make(chan struct{})
	var holding atomic.Int64
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			holding.Add(1)
			defer holding.Add(-1)
			select {
			case <-release:
			case <-time.After(3 * time.Minute):
			}
		}
		io.WriteString(w, "done")
	}))
	t.Cleanup(site.Close)
	f := startFleet(t, site)
	gw := f.startGateway()
	f.apply(events.PoolSpec{Name: "auto", Provider: "local", Size: 2,
		Autoscale: &events.Autoscale{Min: 2, Max: 10, TargetConnections: 4, ScaleDownAfter: events.Duration(10 * time.Second)}})
	f.waitPool("auto", 2, "ready", 60*time.Second)
	scaled := events.EventSubject(events.AggregatePool, "auto", events.PoolScaled)
	if n := f.eventCount(scaled); n != 0 {
		t.Fatalf("%d scaled events before any load", n)
	}

	c := gatewayClient(t, gw, "auto")
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if code, _, _, err := viaGateway(c, site.URL+"/slow"); err != nil || code != 200 {
				failed.Add(1)
			}
		}()
	}
	loadStopped := false
	stopLoad := func() {
		if !loadStopped {
			loadStopped = true
			close(release)
			wg.Wait()
		}
	}
	t.Cleanup(stopLoad)
	waitFor(t, 30*time.Second, "40 slow requests held at the origin", func() bool { return holding.Load() == 40 })
	f.waitPool("auto", 10, "ready", 120*time.Second)
	up := lastScaled(t, f, scaled)
	if up.Size != 10 || !strings.HasPrefix(up.Reason, "autoscale: ") || !strings.Contains(up.Reason, "connections for 10 proxies") {
		t.Errorf("scale-up event: %+v; want size 10 with a reason like %q", up, "autoscale: 40 connections for 10 proxies")
	}

	stopLoad()
	if n := failed.Load(); n != 0 {
		t.Errorf("%d of the 40 slow requests failed", n)
	}
	stoppedAt := time.Now()
	f.waitPool("auto", 2, "ready", 120*time.Second)
	if took := time.Since(stoppedAt); took < 10*time.Second {
		t.Errorf("back to 2 proxies %v after the load stopped; want no sooner than scaleDownAfter (10s)", took)
	}
	down := lastScaled(t, f, scaled)
	if down.Size != 2 || !strings.Contains(down.Reason, "low demand") {
		t.Errorf("scale-down event: %+v; want size 2 with a reason naming the low demand", down)
	}
	t.Logf("scaled events: %d; up: %q; down: %q", f.eventCount(scaled), up.Reason, down.Reason)
}

func lastScaled(t *testing.T, f *fleet, subject string) events.PoolScaledData {
	t.Helper()
	var d events.PoolScaledData
	env, err := events.DecodeEnvelope(lastEventOf(t, f, subject).Data)
	if err != nil || env.DecodeData(&d) != nil {
		t.Fatalf("scaled event: %v", err)
	}
	return d
}

// labelledExample runs the banner's labelled example in make run r: the
// agent's target carries region=local, the pool apply with a placement
// that requires it is accepted (and recorded), and the curl that selects
// region-local is served by a proxy whose view carries the label, while
// a region no proxy has is a 503 naming it.
func labelledExample(t *testing.T, r *runScript, banner, env string) {
	t.Helper()
	apply := bannerLine(t, banner, `nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":3,"placement":{"require":{"region":["local"]}}}'`)
	curl := bannerLine(t, banner, "curl -x http://demo.region-local:x@")
	if out, err := r.shell(env + " && " + apply); err != nil || !strings.Contains(out, `"require":{"region":["local"]}`) {
		t.Fatalf("%s: %v\n%s", apply, err, out)
	}
	var via string
	waitFor(t, 30*time.Second, "the labelled curl to be served", func() bool {
		out, err := r.shell(curl + " -s -f | grep -i '^x-proxyfleet-proxy'")
		if err != nil {
			return false
		}
		_, v, _ := strings.Cut(strings.TrimSpace(out), ":")
		via = strings.TrimSpace(v)
		return via != ""
	})
	out, err := r.shell(env + " && nats kv get fleet-proxies " + via + " --raw")
	if err != nil || !strings.Contains(out, `"labels":{"region":"local"}`) {
		t.Errorf("the labelled curl was served by %s, whose view is %q (%v); want it labelled region=local", via, out, err)
	}
	mars := strings.Replace(curl, "demo.region-local:", "demo.region-mars:", 1)
	out, err = r.shell(mars + " -s -w ' %{http_code}'")
	if err != nil || !strings.HasSuffix(out, " 503") || !strings.Contains(out, "region=mars") {
		t.Errorf("%s: %q %v; want a 503 naming region=mars", mars, out, err)
	}
}
