package forward

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/bantest"
	"proxyfleet/services/gateway/internal/route"
)

// The test proxies p-a, p-b and p-c reach sites from these addresses.
const (
	fromA = "127.0.0.2"
	fromB = "127.0.0.3"
	fromC = "127.0.0.4"
)

// banHarness is a gateway in front of proxies reaching sites from the
// sources given, p-a from the first, and so on.
func banHarness(t *testing.T, spec *events.GatewaySpec, rules []events.BanRule, sources ...string) (*harness, *recordingFleet) {
	t.Helper()
	compiled, err := ban.Compile(rules)
	if err != nil {
		t.Fatal(err)
	}
	f := &recordingFleet{rules: compiled}
	addrs := make([]string, len(sources))
	for i, src := range sources {
		addrs[i] = bantest.Proxy(t, src)
	}
	return newHarnessAt(t, f, spec, addrs...), f
}

func (f *recordingFleet) bans() []ban.Verdict {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]ban.Verdict(nil), f.banned...)
}

func attemptsOf(t *testing.T, hdr http.Header) int {
	t.Helper()
	n, err := strconv.Atoi(hdr.Get(AttemptsHeader))
	if err != nil {
		t.Fatalf("%s %q: %v", AttemptsHeader, hdr.Get(AttemptsHeader), err)
	}
	return n
}

var blocked = events.BanRule{Name: "blocked", Status: []int{403}, Threshold: 100}

// TestBanPageIsRetriedOnAnotherProxy: a site bans p-a; the crawler never
// sees its ban page, only the answer of the proxy tried next.
func TestBanPageIsRetriedOnAnotherProxy(t *testing.T) {
	site := bantest.NewSite(t, "127.0.0.10", fromA)
	h, f := banHarness(t, nil, []events.BanRule{blocked}, fromA, fromB, fromC)
	c := h.client("p")
	twice := 0
	for i := range 6 {
		code, body, hdr := get(t, c, site.URL+"/")
		if code != 200 || body != "hello" || hdr.Get(BannedHeader) != "" {
			t.Fatalf("request %d: %d %q (%s %q); want the 200 of a proxy the site does not ban", i, code, body, BannedHeader, hdr.Get(BannedHeader))
		}
		if n := attemptsOf(t, hdr); n == 2 {
			twice++
		} else if n != 1 {
			t.Errorf("request %d: %d attempts; want 1 or 2", i, n)
		}
		if p := hdr.Get(ProxyHeader); p == "p-a" {
			t.Errorf("request %d answered through the banned p-a", i)
		}
	}
	if seen := site.Seen(fromA); seen == 0 || seen != twice {
		t.Errorf("p-a was tried %d times and %d answers took two attempts; want the same number, more than 0", seen, twice)
	}
	if b := f.bans(); len(b) != 0 {
		t.Errorf("ban reports %+v below the threshold", b)
	}
}

// TestLastBanIsDelivered: when no attempt is left, the crawler gets the
// last ban page, marked with the rule it matched.
func TestLastBanIsDelivered(t *testing.T) {
	one := 1
	cases := []struct {
		name     string
		spec     *events.GatewaySpec
		sources  []string
		dead     bool // a proxy that refuses connections follows
		attempts int
		proxy    string // "" for any
	}{
		{"every proxy banned", nil, []string{fromA, fromB, fromC}, false, 3, ""},
		{"retries bound the attempts", &events.GatewaySpec{Retries: &one}, []string{fromA, fromB, fromC}, false, 2, ""},
		{"the only proxy", nil, []string{fromA}, false, 1, "p-a"},
		{"held while the next proxy is unreachable", &events.GatewaySpec{Retries: &one}, []string{fromA}, true, 2, "p-a"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			site := bantest.NewSite(t, "127.0.0.10", fromA, fromB, fromC)
			h, _ := banHarness(t, c.spec, []events.BanRule{blocked}, c.sources...)
			if c.dead {
				h.table.Set(route.Proxy{ID: "p-z", Pool: "p", Address: testnet.Refusing(t).String()})
			}
			code, body, hdr := get(t, h.client("p"), site.URL+"/")
			if code != 403 || strings.TrimSpace(body) != bantest.BanPage || hdr.Get(BannedHeader) != "blocked" {
				t.Errorf("got %d %q with %s %q; want the site's 403 ban page with blocked", code, body, BannedHeader, hdr.Get(BannedHeader))
			}
			if n := attemptsOf(t, hdr); n != c.attempts || (c.proxy != "" && hdr.Get(ProxyHeader) != c.proxy) {
				t.Errorf("%d attempts, through %s; want %d, through %s", n, hdr.Get(ProxyHeader), c.attempts, c.proxy)
			}
			want := c.attempts
			if c.dead {
				want--
			}
			if seen := site.Seen(fromA) + site.Seen(fromB) + site.Seen(fromC); seen != want {
				t.Errorf("the site saw %d requests; want one per attempt that reached it, %d", seen, want)
			}
		})
	}
}

// TestAttemptsOnEveryAnswer: relayed answers and the gateway's own errors
// carry the attempts made; a site cannot set the gateway's headers.
func TestAttemptsOnEveryAnswer(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set(AttemptsHeader, "99")
		w.Header().Set(BannedHeader, "forged")
		_, _ = w.Write([]byte("hi"))
	})
	h := newHarness(t, &recordingFleet{}, nil, newUpstream(t, ""))
	code, _, hdr := get(t, h.client("p"), site.URL)
	if code != 200 || hdr.Get(AttemptsHeader) != "1" || hdr.Get(BannedHeader) != "" {
		t.Errorf("relayed: %d, %s %q, %s %q; want 200, 1, none", code, AttemptsHeader, hdr.Get(AttemptsHeader), BannedHeader, hdr.Get(BannedHeader))
	}

	dead := newHarnessAt(t, &recordingFleet{}, nil, testnet.Refusing(t).String(), testnet.Refusing(t).String(), testnet.Refusing(t).String())
	code, _, hdr = get(t, dead.client("p"), site.URL)
	if code != http.StatusBadGateway || hdr.Get(AttemptsHeader) != "3" {
		t.Errorf("every proxy dead: %d, %s %q; want 502, 3", code, AttemptsHeader, hdr.Get(AttemptsHeader))
	}

	if code, _, hdr := get(t, newHarness(t, &recordingFleet{}, nil).client("wrong.pool"), site.URL); code != http.StatusProxyAuthRequired || hdr.Get(AttemptsHeader) != "0" {
		t.Errorf("refused login: %d, %s %q; want 407, 0", code, AttemptsHeader, hdr.Get(AttemptsHeader))
	}

	empty := newHarnessAt(t, &recordingFleet{}, nil)
	code, _, hdr = get(t, empty.client("p"), site.URL)
	if code != http.StatusServiceUnavailable || hdr.Get(AttemptsHeader) != "0" {
		t.Errorf("no proxy: %d, %s %q; want 503, 0", code, AttemptsHeader, hdr.Get(AttemptsHeader))
	}
}

// TestCooldownKeepsAProxyOffOneSite: a cooldown rule keeps p-a off the
// site that banned it, while p-a serves another site; once every proxy is
// cooled for the site, the crawler is told 429 until the first may go
// back.
func TestCooldownKeepsAProxyOffOneSite(t *testing.T) {
	banning := bantest.NewSite(t, "127.0.0.10", fromA)
	other := bantest.NewSite(t, "127.0.0.11")
	rule := events.BanRule{Name: "blocked", Status: []int{403}, Action: events.BanActionCooldown, Cooldown: events.Duration(time.Hour)}
	h, f := banHarness(t, nil, []events.BanRule{rule}, fromA, fromB)
	c := h.client("p")
	for i := range 6 {
		if code, body, _ := get(t, c, banning.URL+"/"); code != 200 || body != "hello" {
			t.Fatalf("request %d to the banning site: %d %q; want hello", i, code, body)
		}
		if code, body, _ := get(t, c, other.URL+"/"); code != 200 || body != "hello" {
			t.Fatalf("request %d to the other site: %d %q; want hello", i, code, body)
		}
	}
	if n := banning.Seen(fromA); n != 1 {
		t.Errorf("the banning site saw p-a %d times; want once, then never while cooled", n)
	}
	if n := other.Seen(fromA); n < 2 {
		t.Errorf("the other site saw p-a %d times; want it still served there (about half of 6)", n)
	}
	if b := f.bans(); len(b) != 0 {
		t.Errorf("a cooldown rule reported %+v; want no report", b)
	}

	// The site bans p-b too: its ban page is the last, then nothing is left.
	banning.Ban(fromB)
	code, body, hdr := get(t, c, banning.URL+"/")
	if code != 403 || hdr.Get(BannedHeader) != "blocked" || hdr.Get(AttemptsHeader) != "1" {
		t.Errorf("p-b banned too: %d %q, %s %q after %s attempts; want its ban page, blocked, after 1", code, body, BannedHeader, hdr.Get(BannedHeader), hdr.Get(AttemptsHeader))
	}
	code, body, hdr = get(t, c, banning.URL+"/")
	retry, _ := strconv.Atoi(hdr.Get("Retry-After"))
	if code != http.StatusTooManyRequests || retry < 3500 || retry > 3600 || !strings.Contains(body, "127.0.0.10") || hdr.Get(AttemptsHeader) != "0" {
		t.Errorf("every proxy cooled: %d %q, Retry-After %q, %s %q; want 429 naming the site, about 3600s, 0 attempts",
			code, body, hdr.Get("Retry-After"), AttemptsHeader, hdr.Get(AttemptsHeader))
	}
	if code, _, _ := get(t, c, other.URL+"/"); code != 200 {
		t.Errorf("the other site after both cooled elsewhere: %d; want 200", code)
	}
}

// TestRetryRuleGivesNoVerdict: a retry rule retries the ban page and
// neither cools nor reports the proxy.
func TestRetryRuleGivesNoVerdict(t *testing.T) {
	site := bantest.NewSite(t, "127.0.0.10", fromA)
	rule := events.BanRule{Name: "blocked", Status: []int{403}, Action: events.BanActionRetry}
	h, f := banHarness(t, nil, []events.BanRule{rule}, fromA, fromB)
	c := h.client("p")
	for i := range 6 {
		if code, body, _ := get(t, c, site.URL+"/"); code != 200 || body != "hello" {
			t.Fatalf("request %d: %d %q; want hello", i, code, body)
		}
	}
	if n := site.Seen(fromA); n < 2 {
		t.Errorf("p-a tried %d times; want it tried again after its ban page (no cooldown)", n)
	}
	if b, e := f.bans(), h.srv.cfg.Cooldowns.Entries(); len(b) != 0 || len(e) != 0 {
		t.Errorf("reports %+v, cooldowns %+v; want none", b, e)
	}
}

// TestRetireAfterSites: a proxy cooled on the pool's retireAfterSites
// distinct sites is reported banned, once; 0 never reports it.
func TestRetireAfterSites(t *testing.T) {
	rule := events.BanRule{Name: "blocked", Status: []int{403}, Action: events.BanActionCooldown}
	zero := 0
	for _, c := range []struct {
		name string
		spec *events.GatewaySpec
		want []ban.Verdict
	}{
		{"default 3", nil, []ban.Verdict{{Proxy: "p-a", Rule: "cooled on 3 sites", Action: events.BanActionRetire, Matches: 3}}},
		{"disabled", &events.GatewaySpec{RetireAfterSites: &zero}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, f := banHarness(t, c.spec, []events.BanRule{rule}, fromA, fromB)
			cl := h.client("p")
			for i, ip := range []string{"127.0.0.10", "127.0.0.11", "127.0.0.12", "127.0.0.13"} {
				site := bantest.NewSite(t, ip, fromA)
				for site.Seen(fromA) == 0 {
					if code, _, _ := get(t, cl, site.URL+"/"); code != 200 {
						t.Fatalf("site %d: %d; want p-b's 200", i, code)
					}
				}
				if b := f.bans(); i < 2 && len(b) != 0 {
					t.Fatalf("reported after %d sites: %+v", i+1, b)
				}
			}
			if b := f.bans(); len(b) != len(c.want) || (len(b) == 1 && b[0] != c.want[0]) {
				t.Errorf("reports %+v; want %+v", b, c.want)
			}
		})
	}
}

// TestSessionMovesOffACooledProxy: a session pinned to a proxy that a site
// bans moves to the proxy its retry picked, and stays there.
func TestSessionMovesOffACooledProxy(t *testing.T) {
	banning := bantest.NewSite(t, "127.0.0.10", fromA)
	other := bantest.NewSite(t, "127.0.0.11")
	rule := events.BanRule{Name: "blocked", Status: []int{403}, Action: events.BanActionCooldown}
	h, _ := banHarness(t, nil, []events.BanRule{rule}, fromA, fromB)
	c := h.client("p.session-s1")
	if _, _, hdr := get(t, c, other.URL); hdr.Get(ProxyHeader) != "p-a" {
		t.Fatalf("the session's first request went through %q; want p-a (the first in turn)", hdr.Get(ProxyHeader))
	}
	code, _, hdr := get(t, c, banning.URL)
	if code != 200 || hdr.Get(ProxyHeader) != "p-b" || hdr.Get(AttemptsHeader) != "2" {
		t.Errorf("the session at the banning site: %d through %q after %s attempts; want 200 through p-b after 2", code, hdr.Get(ProxyHeader), hdr.Get(AttemptsHeader))
	}
	for _, u := range []string{banning.URL, other.URL} {
		if _, _, hdr := get(t, c, u); hdr.Get(ProxyHeader) != "p-b" || hdr.Get(AttemptsHeader) != "1" {
			t.Errorf("the session's next request to %s: through %q after %s attempts; want p-b after 1", u, hdr.Get(ProxyHeader), hdr.Get(AttemptsHeader))
		}
	}
}
