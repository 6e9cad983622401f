package web

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/console/internal/fleetview"
)

func tailEvent(t *testing.T, seq uint64, aggregate, id, kind string, data any) bus.Event {
	t.Helper()
	env, err := events.NewEnvelope(id+"."+kind, "test", events.EnvelopeType(aggregate, kind), id, time.Now(), data)
	if err != nil {
		t.Fatal(err)
	}
	return bus.Event{Envelope: env, Seq: seq, Aggregate: aggregate, ID: id, Kind: kind}
}

func TestEventsPageTailsAndFilters(t *testing.T) {
	f := newFixture(t, nil)
	f.tail.Add(tailEvent(t, 1, events.AggregateProxy, "demo-a", events.ProxyRequested, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1"}}))
	f.tail.Add(tailEvent(t, 2, events.AggregateProxy, "other-x", events.ProxyRequested, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "other", Entry: "local", Target: "t1"}}))
	c := f.client(t)
	_, body := c.get("/events")
	if !strings.Contains(body, `<ol id="event-tail" class="tail">`) || strings.Count(body, `<li class="event"`) != 2 {
		t.Fatalf("the events page does not list both events:\n%s", body)
	}
	_, body = c.get("/events?pool=demo")
	if strings.Count(body, `<li class="event"`) != 1 || !strings.Contains(body, `data-pool="demo" data-proxy="demo-a" data-type="requested"`) {
		t.Fatalf("the events of pool demo:\n%s", body)
	}

	// Live: a recycle's replacement arrives on the open stream of proxy demo-a.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := c.live(ctx, "/live/events?pool=demo&proxy=demo-a")
	s.next(t, 5*time.Second)
	f.tail.Add(tailEvent(t, 3, events.AggregateProxy, "demo-b", events.ProxyRequested, events.ProxyRequestedData{
		ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1"}, Replaces: "demo-a", ReplaceReason: "recycled by operator"}))
	for {
		p := s.next(t, 5*time.Second)
		if strings.Contains(p, `data-type=\"replaced\"`) {
			if !strings.Contains(p, "replaced because recycled by operator") || !strings.Contains(p, `data-replacement=\"demo-b\"`) || strings.Contains(p, "other-x") {
				t.Fatalf("the live tail of demo-a:\n%s", p)
			}
			break
		}
	}
}

func TestTargetsPage(t *testing.T) {
	f := newFixture(t, nil)
	f.store.PutAgent("local.t1", &fleetview.Agent{Entry: "local", Target: "t1", Type: "local", Version: "0.2.0", Capacity: 5, Instances: 2,
		Images: []string{"debian-13"}, Labels: map[string]string{"region": "eu"}, At: time.Now(), StartedAt: time.Now().Add(-time.Hour)})
	f.store.PutCheck("local.t1", &fleetview.TargetCheck{Entry: "local", Target: "t1", OK: false, At: time.Now(),
		Verdicts: []fleetview.Verdict{{Check: "squid", OK: true}, {Check: "disk", OK: false, Detail: "98% full"}}})
	f.store.PutCheck("kvm.h2", &fleetview.TargetCheck{Entry: "kvm", Target: "h2", Error: "no answer within 10s", At: time.Now()})
	f.store.PutHealth("health-1", time.Now())
	_, body := f.client(t).get("/targets")
	for _, want := range []string{
		`<tr id="target-local.t1" data-live="true" data-checks-ok="false">`, "local/t1", "0.2.0", "0 placed of 5 (2 instances)", "debian-13", "region=eu",
		`<li class="bad">failing: disk – 98% full</li>`, `<li class="ok">ok: squid</li>`,
		`<tr id="target-kvm.h2" data-live="false"`, "no heartbeat", "no answer within 10s", "health-1: alive",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the targets page lacks %s", want)
		}
	}
}

func TestGatewayPage(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("demo", 2)
	now := time.Now()
	f.store.PutDemand("demo.gw-1", &fleetview.Demand{Pool: "demo", Gateway: "gw-1", RequestsPerSecond: 12.5, Connections: 4, At: now})
	for range 9 {
		f.stats.Add(events.GatewayRequest{Time: now, Pool: "demo", Site: "example.com", Outcome: events.RequestOK, Proxies: []string{"demo-000000"}})
	}
	f.stats.Add(events.GatewayRequest{Time: now, Pool: "demo", Site: "shop.example", Outcome: events.RequestProxyError, Ban: "captcha", Proxies: []string{"demo-000001"}})
	f.store.PutCooldown(events.CooldownKey("demo-000001", "shop.example"), &fleetview.Cooldown{Proxy: "demo-000001", Pool: "demo", Site: "shop.example", Rule: "captcha", Gateway: "gw-1", Until: now.Add(time.Hour)})
	f.store.PutCooldown(events.CooldownKey("demo-000000", "old.example"), &fleetview.Cooldown{Proxy: "demo-000000", Pool: "demo", Site: "old.example", Rule: "captcha", Until: now.Add(-time.Minute)})
	c := f.client(t)
	_, body := c.get("/gateway")
	if strings.Contains(body, "old.example") || !strings.Contains(body, `<tr><th scope="row">demo-000001</th><td><a href="/pools/demo">demo</a></td><td>shop.example</td><td>captcha</td>`) {
		t.Errorf("the gateway page does not list the cooldown in force (only):\n%s", body)
	}
	for _, want := range []string{`<tr id="gw-pool-demo">`, "12.5", "shop.example", "10.0%"} {
		if !strings.Contains(body, want) {
			t.Errorf("the gateway page lacks %s", want)
		}
	}
	_, body = c.get("/")
	if !strings.Contains(body, "12.5") || !strings.Contains(body, "10.0%") {
		t.Errorf("the fleet page lacks the pool's rates:\n%s", body)
	}
	_, body = c.get("/pools/demo")
	if !strings.Contains(body, "1 req, 1 failed, 1 banned") || strings.Count(body, "kept off 1 site<") != 1 {
		t.Errorf("the pool page lacks the gateway's counts and cooldowns per proxy")
	}
}

func TestCrossSitePostsAreRefused(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("demo", 1)
	c := f.client(t)
	_, page := c.get("/pools/demo")
	form := url.Values{"csrf": {csrfOf(t, page)}, "confirm": {"yes"}}
	req, _ := http.NewRequest(http.MethodPost, c.base+"/pools/demo/delete", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "http://evil.example")
	if resp, body := c.do(req); resp.StatusCode != http.StatusForbidden || !strings.Contains(body, "CSRF") {
		t.Errorf("a POST from another origin: %s, want 403", resp.Status)
	}
	if calls := f.api.Calls(); len(calls) != 0 {
		t.Errorf("a cross-site POST reached the API: %v", calls)
	}
}

func TestHistorySVG(t *testing.T) {
	h := string(historySVG("demo", []fleetview.Sample{{Desired: 3, Ready: 0}, {Desired: 3, Ready: 2}, {Desired: 3, Ready: 3}}, 160, 36))
	for _, want := range []string{`role="img"`, `aria-label="Ready against desired proxies of demo over the last 3 samples: now 3 ready of 3 desired"`,
		`<polyline class="hist-desired"`, `<polyline class="hist-ready"`} {
		if !strings.Contains(h, want) {
			t.Errorf("history SVG lacks %s:\n%s", want, h)
		}
	}
	if strings.Contains(h, "style") {
		t.Errorf("the SVG has an inline style:\n%s", h)
	}
}

func TestStaticAssetsAndHeaders(t *testing.T) {
	f := newFixture(t, nil)
	c := f.client(t)
	for path, ctype := range map[string]string{"/static/console.js": "text/javascript", "/static/console.css": "text/css"} {
		resp, body := c.get(path)
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), ctype) || len(body) < 100 {
			t.Errorf("GET %s: %s %q, %d bytes", path, resp.Status, resp.Header.Get("Content-Type"), len(body))
		}
		if resp.Header.Get("Content-Security-Policy") != CSP || resp.Header.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("GET %s: security headers %v", path, resp.Header)
		}
	}
	if resp, _ := c.get("/nope"); resp.StatusCode != http.StatusNotFound || resp.Header.Get("Server-Timing") == "" {
		t.Errorf("GET /nope: %s, Server-Timing %q", resp.Status, resp.Header.Get("Server-Timing"))
	}
	if resp, body := c.get("/healthz"); resp.StatusCode != http.StatusOK || body != "ok\n" {
		t.Errorf("GET /healthz: %s %q", resp.Status, body)
	}
}

func TestOnlyLivePagesOpenAStream(t *testing.T) {
	f := newFixture(t, usersOf(t))
	f.addPool("demo", 1)
	c := f.client(t)
	_, login := c.get("/login")
	if strings.Contains(login, "data-live") || strings.Contains(login, `id="live-status"`) {
		t.Error("the sign-in page asks for live updates")
	}
	if resp, _ := c.get("/live/login"); resp.StatusCode != http.StatusNoContent {
		t.Errorf("GET /live/login: %s, want 204 (an EventSource stops)", resp.Status)
	}
	c.login("otto", "correct horse battery")
	_, page := c.get("/pools/demo")
	if !strings.Contains(page, "<body data-live>") || !strings.Contains(page, `id="live-status"`) {
		t.Error("the pool page does not ask for live updates")
	}
	_, confirm := c.post("/pools/demo/delete", url.Values{"csrf": {csrfOf(t, page)}})
	if !strings.Contains(confirm, `id="confirm"`) || strings.Contains(confirm, "data-live") {
		t.Error("the confirmation page asks for live updates")
	}
	if resp, _ := c.get("/live/pools/demo/delete"); resp.StatusCode != http.StatusNoContent {
		t.Errorf("GET /live/pools/demo/delete: %s, want 204", resp.Status)
	}
}
