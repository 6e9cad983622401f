package traffic

import (
	"fmt"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestRatesPerPoolSiteAndProxy(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 5, 0, time.UTC) // 5s into a slot: the last minute covers 55s
	s := New()
	s.now = func() time.Time { return now }
	add := func(ago time.Duration, pool, site, outcome, ban string, proxies ...string) {
		s.Add(events.GatewayRequest{Time: now.Add(-ago), Pool: pool, Site: site, Outcome: outcome, Ban: ban, Proxies: proxies})
	}
	for i := range 60 {
		add(time.Duration(i)*time.Second, "demo", "example.com", events.RequestOK, "", "demo-a")
	}
	for i := range 6 {
		add(time.Duration(i)*time.Second, "demo", "shop.example", events.RequestProxyError, "", "demo-a", "demo-b")
	}
	add(5*time.Second, "demo", "shop.example", events.RequestOK, "captcha", "demo-b")
	add(2*time.Minute, "demo", "old.example", events.RequestError, "")    // in the window, not in the last minute
	add(10*time.Minute, "demo", "older.example", events.RequestError, "") // outside the window
	add(time.Second, "", "x.example", events.RequestError, "")

	r := s.Pools()["demo"]
	if r.Requests != 63 || r.Failures != 6 || r.Bans != 1 || r.Span != 55*time.Second {
		t.Fatalf("demo over the last minute: %+v", r.Counts)
	}
	if got := fmt.Sprintf("%.3f %.3f", r.PerSecond(), r.FailureShare()); got != "1.145 0.095" {
		t.Errorf("rate and failure share %s", got)
	}
	if r := s.Pools()[NoPool]; r.Requests != 1 || r.Failures != 1 {
		t.Errorf("requests of no pool: %+v", r.Counts)
	}
	px := s.Proxies("demo")
	if px["demo-a"] != (Counts{Requests: 66, Failures: 6}) || px["demo-b"] != (Counts{Requests: 7, Failures: 6, Bans: 1}) {
		t.Errorf("per proxy: %+v", px)
	}
	top := s.TopFailing(10)
	if len(top) != 3 || top[0].Site != "shop.example" || top[0].Failures != 6 || top[0].Bans != 1 || top[1].Site != "old.example" && top[1].Site != "x.example" {
		t.Errorf("top failing: %+v", top)
	}
	// Ten minutes on, everything has left the window.
	now = now.Add(10 * time.Minute)
	if len(s.Pools()) != 0 || len(s.TopFailing(10)) != 0 || len(s.Proxies("demo")) != 0 {
		t.Errorf("counts left after the window: %+v", s.Pools())
	}
}

func TestSitesAreBounded(t *testing.T) {
	now := time.Now()
	s := New()
	s.now = func() time.Time { return now }
	for i := range 3 * MaxSites {
		s.Add(events.GatewayRequest{Time: now, Pool: "demo", Site: fmt.Sprintf("site-%d.example", i), Outcome: events.RequestOK})
	}
	sites := s.Sites(RateSpan)
	if len(sites) != MaxSites+1 {
		t.Fatalf("%d sites kept, want %d and one %q", len(sites), MaxSites, OtherSites)
	}
	var other int64
	for _, r := range sites {
		if r.Site == OtherSites {
			other = r.Requests
		}
	}
	if other != 2*MaxSites {
		t.Errorf("%q counts %d requests, want %d", OtherSites, other, 2*MaxSites)
	}
}
