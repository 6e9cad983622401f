package e2e_test

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// tierAnswer is what a client sees of an answer through the gateway.
type tierAnswer struct {
	code        int
	body        string
	proxy, pool string
	attempts    int
	banned      string
	err         error
}

// throughTiers GETs target with c.
func throughTiers(c *http.Client, target string) tierAnswer {
	resp, err := c.Get(target)
	if err != nil {
		return tierAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	n, _ := strconv.Atoi(resp.Header.Get("X-Proxyfleet-Attempts"))
	return tierAnswer{code: resp.StatusCode, body: string(b), proxy: resp.Header.Get("X-Proxyfleet-Proxy"),
		pool: resp.Header.Get("X-Proxyfleet-Pool"), attempts: n, banned: resp.Header.Get("X-Proxyfleet-Banned"), err: err}
}

// bySource is a loopback site that counts the requests it gets per source
// address and answers each with answer(source).
type bySource struct {
	*httptest.Server
	mu   sync.Mutex
	seen map[string]int
}

// newBySource starts a bySource on addr (ip:0) answering with answer.
func newBySource(t *testing.T, addr string, answer func(w http.ResponseWriter, source string)) *bySource {
	t.Helper()
	s := &bySource{seen: map[string]int{}}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		s.mu.Lock()
		s.seen[host]++
		s.mu.Unlock()
		answer(w, host)
	}))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s.Listener.Close()
	s.Listener = l
	s.Start()
	t.Cleanup(s.Close)
	return s
}

// from is how many requests s got from source.
func (s *bySource) from(source string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[source]
}

// TestFallbackTierThroughTheGateway is issue 28's tiers on real
// processes: a cheap pool (on a target egressing from 127.0.0.2) falls
// back to a dear pool (egressing from 127.0.0.3); a site answers every
// request from the cheap pool's proxies with a ban page by the cheap
// pool's rule, and real pages to the dear pool's. The crawler gets the
// pages, with X-Proxyfleet-Pool: dear; then, for tierMemory, the site's
// requests start at dear (one attempt, the cheap proxies see nothing)
// while another site is still served by cheap; once tierMemory has
// passed, the site starts at cheap again. The request log records the
// tier.
func TestFallbackTierThroughTheGateway(t *testing.T) {
	cheapAgent := &labelledAgent{target: "t-cheap", labels: "tier=cheap", source: "127.0.0.2"}
	dearAgent := &labelledAgent{target: "t-dear", labels: "tier=dear", source: "127.0.0.3"}
	// The gateway remembers tiers per site, and an IP address is its own
	// site whatever the port: the two sites listen on two addresses.
	needLoopbackSources(t, "127.0.0.5", "127.0.0.6")
	shop := newBySource(t, "127.0.0.5:0", func(w http.ResponseWriter, source string) {
		if source == cheapAgent.source {
			w.WriteHeader(http.StatusForbidden)
			io.WriteString(w, "<html>blocked: bad neighbourhood</html>")
			return
		}
		io.WriteString(w, "<html>shop page</html>")
	})
	other := newBySource(t, "127.0.0.6:0", func(w http.ResponseWriter, _ string) { io.WriteString(w, "other page") })
	f := startLabelledFleet(t, []*labelledAgent{cheapAgent, dearAgent}, shop.Server, other.Server)
	gw := f.startGateway()

	const tierMemory = 15 * time.Second
	f.apply(events.PoolSpec{Name: "dear", Provider: "local", Size: 1,
		Placement: &events.Placement{Require: map[string][]string{"tier": {"dear"}}}})
	f.apply(events.PoolSpec{Name: "cheap", Provider: "local", Size: 2,
		Placement: &events.Placement{Require: map[string][]string{"tier": {"cheap"}}},
		Gateway: &events.GatewaySpec{Fallback: []string{"dear"}, TierMemory: events.Duration(tierMemory),
			// retry: a ban page is only retried (no proxy is cooled or
			// reported), so what keeps the cheap pool off the site is the
			// tier memory alone.
			BanRules: []events.BanRule{{Name: "blocked", Status: []int{403}, Body: "blocked", Action: "retry"}}}})
	f.waitPool("dear", 1, "ready", 90*time.Second)
	f.waitPool("cheap", 2, "ready", 90*time.Second)

	c := gatewayClient(t, gw, "cheap")
	waitFor(t, 30*time.Second, "the gateway to route over cheap's 2 proxies", func() bool {
		seen := map[string]bool{}
		for range 4 {
			if a := throughTiers(c, other.URL+"/"); a.err == nil && a.code == 200 && a.pool == "cheap" {
				seen[a.proxy] = true
			}
		}
		return len(seen) == 2
	})
	waitFor(t, 30*time.Second, "the gateway to route over dear", func() bool {
		a := throughTiers(gatewayClient(t, gw, "dear"), other.URL+"/")
		return a.err == nil && a.code == 200 && a.pool == "dear"
	})

	// The first request for the shop: both cheap proxies get the ban
	// page, dear serves it.
	a := throughTiers(c, shop.URL+"/item/1")
	if a.err != nil || a.code != 200 || a.body != "<html>shop page</html>" || a.pool != "dear" {
		t.Fatalf("first shop request as cheap: %d %q pool %q %v; want dear's page", a.code, a.body, a.pool, a.err)
	}
	remembered := time.Now()
	banned := shop.from(cheapAgent.source)
	if banned != 2 || a.attempts != 3 || a.banned != "" {
		t.Errorf("first shop request: the site banned %d requests of cheap's proxies, %d attempts, X-Proxyfleet-Banned %q; want 2 (both cheap proxies), 3 attempts (2 cheap, 1 dear) and no ban header",
			banned, a.attempts, a.banned)
	}

	// While the memory lasts, the shop starts at dear.
	for i := range 10 {
		a := throughTiers(c, shop.URL+"/item/"+strconv.Itoa(i+2))
		if a.err != nil || a.code != 200 || a.pool != "dear" || a.attempts != 1 {
			t.Errorf("shop request %d as cheap within tierMemory: %d pool %q, %d attempts, %v; want 200 from dear in 1 attempt", i+2, a.code, a.pool, a.attempts, a.err)
		}
	}
	if took := time.Since(remembered); took >= tierMemory {
		t.Fatalf("the 10 requests took %s, past tierMemory (%s): the memory could not be checked", took, tierMemory)
	}
	if n := shop.from(cheapAgent.source); n != banned {
		t.Errorf("cheap's proxies brought the shop %d more requests within tierMemory; want none", n-banned)
	}
	if n := shop.from(dearAgent.source); n != 11 {
		t.Errorf("dear's proxy brought the shop %d requests; want all 11", n)
	}
	// The memory is the shop's: another site still starts at cheap.
	if a := throughTiers(c, other.URL+"/"); a.err != nil || a.code != 200 || a.pool != "cheap" || a.attempts != 1 {
		t.Errorf("another site as cheap: %d pool %q, %d attempts, %v; want cheap's answer in 1 attempt", a.code, a.pool, a.attempts, a.err)
	}

	// Once tierMemory has passed, the shop starts at cheap again and
	// returns to dear.
	time.Sleep(time.Until(remembered.Add(tierMemory + time.Second)))
	a = throughTiers(c, shop.URL+"/item/after")
	if a.err != nil || a.code != 200 || a.pool != "dear" || a.attempts != 3 || shop.from(cheapAgent.source) != banned+2 {
		t.Errorf("shop request after tierMemory: %d pool %q, %d attempts, cheap's proxies brought %d more, %v; want cheap tried again (2 more), then dear in 3 attempts",
			a.code, a.pool, a.attempts, shop.from(cheapAgent.source)-banned, a.err)
	}

	// The request log records the tier that served: dear, for pool cheap.
	waitFor(t, 15*time.Second, "a request-log record of pool cheap served by tier dear", func() bool {
		return f.requestLogHas(func(r events.GatewayRequest) bool {
			return r.Pool == "cheap" && r.Tier == "dear" && r.Outcome == events.RequestOK && r.Status == 200 && len(r.Proxies) == 3
		})
	})
}

// requestLogHas reports whether some record of the request log
// (FLEET_GATEWAY_LOG) satisfies match.
func (f *fleet) requestLogHas(match func(events.GatewayRequest) bool) bool {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := f.conn.JS.Stream(ctx, bus.RequestLogStream)
	if err != nil {
		return false
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return false
	}
	info, err := s.Info(ctx)
	if err != nil {
		return false
	}
	for n := info.State.Msgs; n > 0; n-- {
		m, err := cons.Next(jetstream.FetchMaxWait(2 * time.Second))
		if err != nil {
			return false
		}
		var r events.GatewayRequest
		if json.Unmarshal(m.Data(), &r) == nil && match(r) {
			return true
		}
	}
	return false
}
