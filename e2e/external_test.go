package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

// sellerProxy is a bought upstream proxy the test runs itself
// ([testnet.AuthProxy]: plain requests and CONNECT behind its own
// basic-auth pair, recording every credential it is sent, naming itself
// to the origin in X-Seller), with the pair it demands.
type sellerProxy struct {
	*testnet.AuthProxy
	name, user, pass string
	addr             string
}

func newSellerProxy(t *testing.T, name, user, pass string) *sellerProxy {
	t.Helper()
	p := testnet.NewAuthProxy(t, name, user, pass)
	return &sellerProxy{AuthProxy: p, name: name, user: user, pass: pass, addr: p.Addr}
}

// creds returns the credentials the proxy was sent, and how often it
// served and refused.
func (p *sellerProxy) creds() (seen map[string]int, served, rejected int) { return p.Pairs() }

// externalView is the part of a fleet-proxies value of an external proxy
// the test reads.
type externalView struct {
	ID            string            `json:"id"`
	Pool          string            `json:"pool"`
	Entry         string            `json:"entry"`
	Target        string            `json:"target"`
	State         string            `json:"state"`
	Address       string            `json:"address"`
	Labels        map[string]string `json:"labels"`
	Reason        string            `json:"reason"`
	DisabledUntil time.Time         `json:"disabledUntil"`
}

func (f *fleet) externalViews(pool string) map[string]externalView {
	f.t.Helper()
	out := map[string]externalView{}
	for _, raw := range f.views(bus.BucketProxies) {
		var v externalView
		if err := json.Unmarshal(raw, &v); err != nil {
			f.t.Fatalf("fleet-proxies value is not JSON: %s", raw)
		}
		if v.Pool == pool {
			out[v.Address] = v
		}
	}
	return out
}

// TestExternalPool is issue 28's acceptance of proxies you bought, with
// real processes (planner, health, gateway): three upstream proxies the
// test runs, each behind its own credentials, applied as an external pool
// with labels. They are probed ready with their labels; the gateway routes
// through all three, each seeing only its own credentials; a site that
// bans one of them (a ban rule with action retire) gets it disabled, not
// deleted, and no proxy is requested in its place; after disableFor and a
// good probe it is ready again. Its credentials appear in no event, log
// line, request-log record or view. Bad external input is refused with
// the field path and writes nothing.
func TestExternalPool(t *testing.T) {
	f := newFleet(t)
	f.dumpLogsOnFailure()
	t.Cleanup(func() {
		if t.Failed() {
			l := f.log("gateway")
			if len(l) > 6000 {
				l = l[len(l)-6000:]
			}
			t.Logf("---- gateway log (tail) ----\n%s", l)
		}
	})
	f.start("planner", "--reconcile-interval", "200ms", "--external-allow-cidrs", "127.0.0.0/8")
	f.startHealth()
	gw := f.startGateway()
	f.waitLeader()

	// Bad input first, on a quiet fleet: each refused with its field
	// path, nothing appended.
	t.Run("bad input", func(t *testing.T) {
		// The leader's start-up bookkeeping is in before the count.
		var seq uint64
		waitFor(t, 30*time.Second, "a quiet event log", func() bool {
			prev := seq
			seq = f.lastSeq(bus.EventsStream)
			time.Sleep(500 * time.Millisecond)
			return seq == prev && f.lastSeq(bus.EventsStream) == seq
		})
		before := f.intentEvents()
		for _, c := range []struct{ name, url string }{
			{"https scheme", "https://u:bad-input-pw-1@127.0.0.1:3128"},
			{"socks5 scheme", "socks5://u:bad-input-pw-2@127.0.0.1:1080"},
			{"private address the planner does not allow", "http://u:bad-input-pw-3@10.0.0.1:3128"},
			{"link-local metadata address", "http://u:bad-input-pw-4@169.254.169.254:80"},
		} {
			body := fmt.Sprintf(`{"name":"refused","provider":"external","external":{"proxies":[{"url":"http://127.0.0.1:9"},{"url":%q}]}}`, c.url)
			r := f.req("fleet.api.pool.apply", body, nil)
			if r.Code != "400" && r.Code != "422" {
				t.Errorf("%s: code %q, want 400 or 422 (body %s)", c.name, r.Code, r.Data)
				continue
			}
			if !bytes.Contains(r.Data, []byte("external.proxies[1].url")) {
				t.Errorf("%s: the refusal does not name external.proxies[1].url: %s", c.name, r.Data)
			}
			if pw := c.url[strings.Index(c.url, ":bad")+1 : strings.Index(c.url, "@")]; bytes.Contains(r.Data, []byte(pw)) {
				t.Errorf("%s: the refusal quotes the password: %s", c.name, r.Data)
			}
		}
		if after := f.intentEvents(); after != before {
			t.Errorf("refused applies appended events: %d -> %d", before, after)
		}
		if last := f.lastSeq(bus.EventsStream); last != seq {
			t.Errorf("FLEET_EVENTS' last sequence moved from %d to %d over the refused applies", seq, last)
		}
		if n := f.eventCount("fleet.evt.pool.refused.>"); n != 0 {
			t.Errorf("the refused pool has %d events", n)
		}
		if _, ok := f.views(bus.BucketPools)["refused"]; ok {
			t.Error("the refused pool is in fleet-pools")
		}
	})

	// The site: pages, and a captcha for the seller it bans while banning.
	var banning atomic.Value
	banning.Store("")
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if b := banning.Load().(string); b != "" && r.Header.Get("X-Seller") == b {
			w.WriteHeader(http.StatusForbidden)
			_, _ = io.WriteString(w, "captcha: prove you are human")
			return
		}
		_, _ = io.WriteString(w, "page via "+r.Header.Get("X-Seller"))
	}))
	t.Cleanup(site.Close)

	sellers := []*sellerProxy{
		newSellerProxy(t, "eu", "buyer-eu", "Sekrit-EU-2207"),
		newSellerProxy(t, "us", "buyer-us", "Sekrit-US-2213"),
		newSellerProxy(t, "ap", "buyer-ap", "Sekrit-AP-2221"),
	}
	spec := events.PoolSpec{Name: "bought", Provider: events.ProviderExternal,
		External: &events.External{DisableFor: events.Duration(events.MinDisableFor)},
		Gateway: &events.GatewaySpec{BanRules: []events.BanRule{
			{Name: "captcha", Status: []int{http.StatusForbidden}, Body: "captcha", Action: events.BanActionRetire, Threshold: 1},
		}},
	}
	bySeller := map[string]*sellerProxy{}
	for _, s := range sellers {
		spec.External.Proxies = append(spec.External.Proxies, events.ExternalProxy{
			URL:    "http://" + s.user + ":" + s.pass + "@" + s.addr,
			Labels: map[string]string{"region": s.name, "provider": "seller"},
		})
		bySeller[s.addr] = s
	}
	applied := f.apply(spec)
	if b, _ := json.Marshal(applied); bytes.Contains(b, []byte("Sekrit-")) {
		t.Fatalf("the apply's answer holds a credential: %s", b)
	}

	// Probed ready, with their labels, placed on entry and target external.
	var views map[string]externalView
	waitFor(t, 60*time.Second, "3 ready external proxies", func() bool {
		views = f.externalViews("bought")
		n := 0
		for _, v := range views {
			if v.State == events.ProxyReady {
				n++
			}
		}
		return len(views) == 3 && n == 3
	})
	ids := map[string]*sellerProxy{}
	for addr, v := range views {
		s := bySeller[addr]
		if s == nil {
			t.Fatalf("a proxy at %s, which the pool does not list", addr)
		}
		if v.Labels["region"] != s.name || v.Labels["provider"] != "seller" || v.Entry != events.ProviderExternal || v.Target != events.ProviderExternal {
			t.Errorf("proxy %s at %s: labels %v on %s/%s; want region=%s provider=seller on external/external", v.ID, addr, v.Labels, v.Entry, v.Target, s.name)
		}
		ids[v.ID] = s
	}
	requested := f.eventCount("fleet.evt.proxy.*.requested")

	// Routed through all three, each sent its own credentials only.
	c := gatewayClient(t, gw, "bought")
	waitFor(t, 30*time.Second, "the gateway to route over the 3", func() bool {
		seen := map[string]bool{}
		for range 9 {
			if code, _, via, err := viaGateway(c, site.URL+"/warm"); err == nil && code == 200 {
				seen[via] = true
			}
		}
		return len(seen) == 3
	})
	via := map[string]int{}
	for i := range 30 {
		code, body, id, err := viaGateway(c, fmt.Sprintf("%s/page/%d", site.URL, i))
		if err != nil || code != 200 {
			t.Fatalf("request %d through the gateway: %d %q %v", i, code, body, err)
		}
		s := ids[id]
		if s == nil {
			t.Fatalf("request %d served by %q, not one of the pool's 3", i, id)
		}
		if body != "page via "+s.name {
			t.Fatalf("request %d: X-Proxyfleet-Proxy %s (seller %s), but the page says %q", i, id, s.name, body)
		}
		via[id]++
	}
	if len(via) != 3 {
		t.Errorf("30 requests went through %v; want all 3", via)
	}
	for _, s := range sellers {
		seen, served, rejected := s.creds()
		if served == 0 || rejected != 0 {
			t.Errorf("seller %s served %d, refused %d; want some served, none refused", s.name, served, rejected)
		}
		for pair := range seen {
			if pair != s.user+":"+s.pass {
				t.Errorf("seller %s was sent other credentials (user %q)", s.name, strings.SplitN(pair, ":", 2)[0])
			}
		}
	}

	// The site bans the us seller: the gateway's verdict disables it.
	victim := sellers[1]
	var victimID string
	for id, s := range ids {
		if s == victim {
			victimID = id
		}
	}
	banning.Store(victim.name)
	var disabled externalView
	waitFor(t, 60*time.Second, "the banned proxy disabled", func() bool {
		for range 3 {
			_, _, _, _ = viaGateway(c, site.URL+"/banned")
		}
		disabled = f.externalViews("bought")[victim.addr]
		return disabled.State == events.ProxyDisabled
	})
	banning.Store("")
	if disabled.ID != victimID || disabled.DisabledUntil.IsZero() || !strings.Contains(disabled.Reason, "captcha") {
		t.Errorf("the disabled proxy: %+v; want %s with disabledUntil and a reason naming the rule", disabled, victimID)
	}
	if n := len(f.externalViews("bought")); n != 3 {
		t.Errorf("the pool lists %d proxies after the ban; want still 3", n)
	}
	if n := f.eventCount("fleet.evt.proxy.*.requested"); n != requested {
		t.Errorf("requested events %d -> %d after the ban: nothing may be requested for an external pool", requested, n)
	}
	if n := f.eventCount("fleet.evt.proxy." + victimID + ".>"); n == 0 || f.eventCount("fleet.evt.proxy."+victimID+".deleted.>")+f.eventCount("fleet.evt.proxy."+victimID+".retiring") != 0 {
		t.Errorf("the banned proxy was retired or deleted")
	}
	// While disabled, the gateway does not route to it.
	for i := range 6 {
		if _, _, id, err := viaGateway(c, fmt.Sprintf("%s/while-disabled/%d", site.URL, i)); err == nil && id == victimID {
			t.Fatalf("request %d went through the disabled proxy", i)
		}
	}

	// Back after disableFor (10s) and a good probe.
	waitFor(t, 60*time.Second, "the disabled proxy ready again", func() bool {
		return f.externalViews("bought")[victim.addr].State == events.ProxyReady
	})
	if now := time.Now(); now.Before(disabled.DisabledUntil) {
		t.Errorf("ready again at %v, before its disabledUntil %v", now, disabled.DisabledUntil)
	}
	waitFor(t, 30*time.Second, "the gateway to route to it again", func() bool {
		for range 6 {
			if _, _, id, err := viaGateway(c, site.URL+"/again"); err == nil && id == victimID {
				return true
			}
		}
		return false
	})
	if n := len(f.externalViews("bought")); n != 3 {
		t.Errorf("the pool lists %d proxies; want 3", n)
	}
	if n := f.eventCount("fleet.evt.proxy.*.requested"); n != requested {
		t.Errorf("requested events %d -> %d: nothing may be requested for an external pool", requested, n)
	}

	// The credentials appear in no event, log line, request-log record or
	// view (every bucket but fleet-secrets, whose job is to hold them, and
	// the sealed buckets, which hold them only sealed).
	secrets := []string{"Sekrit-EU-2207", "Sekrit-US-2213", "Sekrit-AP-2221"}
	where := map[string][]byte{
		"FLEET_EVENTS":      f.rawStream(bus.EventsStream),
		"FLEET_GATEWAY_LOG": f.rawStream(bus.RequestLogStream),
	}
	for _, n := range []string{"planner", "health", "gateway"} {
		where[n+" log"] = []byte(f.log(n))
	}
	names := f.conn.JS.KeyValueStoreNames(context.Background())
	for name := range names.Name() {
		if name == bus.BucketSecrets {
			continue
		}
		for k, v := range f.views(name) {
			where[name+"/"+k] = v
		}
	}
	for what, b := range where {
		for _, s := range secrets {
			if bytes.Contains(b, []byte(s)) {
				t.Errorf("the credential %s appears in %s", s, what)
			}
		}
	}
	if r := f.req("fleet.api.pool.get", `{"name":"bought"}`, nil); bytes.Contains(r.Data, []byte("Sekrit-")) {
		t.Errorf("pool.get answers a credential: %s", r.Data)
	}
}
