package forward

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// inFlight is an origin that counts the requests it serves at once and
// keeps the most it saw; each request takes delay, or, when hold is set,
// a request to a path under /held waits for hold to close.
type inFlight struct {
	now, most atomic.Int32
	served    atomic.Int32
}

func (f *inFlight) handler(delay time.Duration, hold <-chan struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := f.now.Add(1)
		defer f.now.Add(-1)
		for m := f.most.Load(); n > m && !f.most.CompareAndSwap(m, n); m = f.most.Load() {
		}
		if hold != nil {
			if strings.HasPrefix(r.URL.Path, "/held") {
				<-hold
			}
		} else {
			time.Sleep(delay)
		}
		f.served.Add(1)
		_, _ = io.WriteString(w, "ok")
	}
}

// concurrently GETs u n times at once through c and returns the statuses.
func concurrently(c *http.Client, u string, n int) []int {
	codes := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			resp, err := c.Get(u)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			codes[i] = resp.StatusCode
		})
	}
	wg.Wait()
	return codes
}

// TestPerSiteConcurrencyHoldsTheLoad: 50 requests at once to one site
// through 3 proxies held to 2 each reach the site at most 6 at a time, and
// all of them are served (the queue timeout is far longer than the wait).
func TestPerSiteConcurrencyHoldsTheLoad(t *testing.T) {
	var count inFlight
	site := origin(t, count.handler(20*time.Millisecond, nil))
	spec := &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 2, QueueTimeout: events.Duration(time.Minute)}}
	h := newHarness(t, &recordingFleet{}, spec, newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, ""))
	codes := concurrently(h.client("p"), site.URL+"/", 50)
	for i, c := range codes {
		if c != http.StatusOK {
			t.Fatalf("request %d: status %d (all: %v); want every one served", i, c, codes)
		}
	}
	if most := count.most.Load(); most > 6 {
		t.Errorf("the site saw %d requests at once; want at most 6 (3 proxies × 2)", most)
	}
	if n := count.served.Load(); n != 50 {
		t.Errorf("the site served %d requests, want 50", n)
	}
}

// TestPerSiteRateHoldsRequests: requests beyond a proxy's burst wait for
// their token: 10 at once at 10/s (burst 3) take at least 0.7s.
func TestPerSiteRateHoldsRequests(t *testing.T) {
	var count inFlight
	site := origin(t, count.handler(0, nil))
	spec := &events.GatewaySpec{PerSite: &events.PerSite{Rate: 10, QueueTimeout: events.Duration(time.Minute)}}
	h := newHarness(t, &recordingFleet{}, spec, newUpstream(t, ""))
	start := time.Now()
	codes := concurrently(h.client("p"), site.URL+"/", 10)
	took := time.Since(start)
	for i, c := range codes {
		if c != http.StatusOK {
			t.Fatalf("request %d: status %d; want every one served", i, c)
		}
	}
	if took < 700*time.Millisecond {
		t.Errorf("10 requests at 10/s with a burst of 3 took %s; want at least 700ms", took)
	}
}

// TestEveryProxyAtItsLimitIs429: with every proxy at its limit for a site
// past the queue timeout, a request is answered 429 with Retry-After and a
// line naming the site and the limit; another site is not held, and a
// CONNECT tunnel holds its place for its whole life.
func TestEveryProxyAtItsLimitIs429(t *testing.T) {
	var count inFlight
	hold := make(chan struct{})
	var release sync.Once
	site := origin(t, count.handler(0, hold))
	t.Cleanup(func() { release.Do(func() { close(hold) }) }) // before the origin closes
	spec := &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 1, QueueTimeout: events.Duration(200 * time.Millisecond)}}
	h := newHarness(t, &recordingFleet{}, spec, newUpstream(t, ""), newUpstream(t, ""))
	c := h.client("p")
	held := make(chan []int, 1)
	go func() { held <- concurrently(c, site.URL+"/held", 2) }()
	testwait.Until(t, 20*time.Second, "both proxies to carry a held request", func() bool { return count.now.Load() == 2 })

	code, body, hdr := get(t, c, site.URL+"/more")
	if code != http.StatusTooManyRequests || hdr.Get("Retry-After") != "1" {
		t.Fatalf("a third request: %d, Retry-After %q; want 429 with Retry-After 1", code, hdr.Get("Retry-After"))
	}
	if want := "every usable proxy is at its limit for site 127.0.0.1 (perSite.concurrency 1, per proxy)"; !strings.Contains(body, want) || strings.Count(strings.TrimSpace(body), "\n") != 0 {
		t.Errorf("429 body %q; want one line with %q", body, want)
	}
	// Another site (the same origin by another name) is not held.
	other := strings.Replace(site.URL, "127.0.0.1", "localhost", 1)
	if code, _, _ := get(t, c, other+"/other-site"); code != http.StatusOK {
		t.Errorf("a request to another site while the first is at its limit: %d; want 200", code)
	}
	release.Do(func() { close(hold) })
	for i, code := range <-held {
		if code != http.StatusOK {
			t.Errorf("held request %d: %d", i, code)
		}
	}

	// A tunnel counts as one request in flight while it is open.
	gw := strings.TrimPrefix(h.gw.URL, "http://")
	target := strings.TrimPrefix(site.URL, "http://")
	t1, status := dialTunnel(t, gw, "", target)
	if !strings.HasPrefix(status, "200") {
		t.Fatalf("first tunnel: %s", status)
	}
	t2, status := dialTunnel(t, gw, "", target)
	if !strings.HasPrefix(status, "200") {
		t.Fatalf("second tunnel: %s", status)
	}
	if code, _, _ := get(t, c, site.URL+"/while-tunnels"); code != http.StatusTooManyRequests {
		t.Fatalf("a request while two tunnels hold both proxies: %d; want 429", code)
	}
	_ = t1.Close()
	_ = t2.Close()
	testwait.Until(t, 20*time.Second, "a request to be served once the tunnels closed", func() bool {
		resp, err := c.Get(site.URL + "/after-tunnels")
		if err != nil {
			return false
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// TestSessionRotatesThroughTheGateway: a session with maxRequests 10 used
// 30 times is carried by 3 proxies in turn, 10 requests each.
func TestSessionRotatesThroughTheGateway(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	spec := &events.GatewaySpec{Session: &events.SessionRotation{MaxRequests: 10}}
	h := newHarness(t, &recordingFleet{}, spec, newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, ""))
	c := h.client("p.session-s1")
	var order []string
	count := map[string]int{}
	for i := range 30 {
		code, _, hdr := get(t, c, fmt.Sprintf("%s/%d", site.URL, i))
		if code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
		x := hdr.Get(ProxyHeader)
		if len(order) == 0 || order[len(order)-1] != x {
			order = append(order, x)
		}
		count[x]++
	}
	if len(order) != 3 || len(count) != 3 || count[order[0]] != 10 || count[order[1]] != 10 || count[order[2]] != 10 {
		t.Fatalf("30 requests of a session with maxRequests 10: proxies in order %v, counts %v; want 3 proxies in turn, 10 each", order, count)
	}
}
