package route

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// TestPerSiteConcurrency: a proxy carries at most perSite.concurrency
// requests to one site at once; past that the pick fails with a
// LimitError naming the site, another site is not held, and a request's
// end frees its place.
func TestPerSiteConcurrency(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.SetSpec("demo", &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 2}})
	fill(tb, "demo", 3)
	a := Target{Pool: "demo", Site: "a.example"}
	var held []Proxy
	count := map[string]int{}
	for range 6 {
		x, err := tb.Pick(a)
		if err != nil {
			t.Fatalf("pick %d of 6: %v", len(held)+1, err)
		}
		if x.Site != "a.example" {
			t.Fatalf("picked proxy counts against site %q, want a.example", x.Site)
		}
		held = append(held, x)
		count[x.ID]++
	}
	if len(count) != 3 || count["demo-0"] != 2 || count["demo-1"] != 2 || count["demo-2"] != 2 {
		t.Fatalf("6 requests over 3 proxies at 2 each: %v", count)
	}
	_, err := tb.Pick(a)
	lerr, ok := errors.AsType[*LimitError](err)
	if !ok || !errors.Is(err, ErrAtLimit) || lerr.Site != "a.example" || lerr.RetryAfter != time.Second {
		t.Fatalf("7th pick: %v; want a LimitError for a.example with RetryAfter 1s", err)
	}
	if want := `pool "demo": every usable proxy is at its limit for site a.example (perSite.concurrency 2, per proxy)`; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
	// Another site is not held by a.example's load.
	if x, err := tb.Pick(Target{Pool: "demo", Site: "b.example"}); err != nil {
		t.Fatalf("pick for another site: %v", err)
	} else {
		tb.Done(x)
	}
	// A request without a site is not limited.
	if _, err := tb.Pick(Target{Pool: "demo"}); err != nil {
		t.Fatalf("pick without a site: %v", err)
	}
	tb.Done(held[4])
	x, err := tb.Pick(a)
	if err != nil || x.ID != held[4].ID {
		t.Fatalf("after one request ended: %v %v; want %s", x.ID, err, held[4].ID)
	}
}

// TestPerSiteRate: a proxy starts at most perSite.rate requests per second
// at one site, after a burst of PerSite.Burst; the LimitError says when the
// next token comes.
func TestPerSiteRate(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{PerSite: &events.PerSite{Rate: 2}})
	fill(tb, "demo", 1)
	a := Target{Pool: "demo", Site: "a.example"}
	x, err := tb.Pick(a)
	if err != nil {
		t.Fatal(err)
	}
	tb.Done(x) // rate limits starts, not requests in flight
	_, err = tb.Pick(a)
	lerr, ok := errors.AsType[*LimitError](err)
	if !ok || lerr.RetryAfter != 500*time.Millisecond {
		t.Fatalf("second pick within the same instant: %v; want a LimitError with RetryAfter 500ms", err)
	}
	now = now.Add(499 * time.Millisecond)
	if _, err := tb.Pick(a); !errors.Is(err, ErrAtLimit) {
		t.Fatalf("pick after 499ms: %v; want ErrAtLimit", err)
	}
	now = now.Add(time.Millisecond)
	if _, err := tb.Pick(a); err != nil {
		t.Fatalf("pick after 500ms: %v", err)
	}
	// Idle for long, the bucket holds one token (the burst), not more.
	now = now.Add(time.Minute)
	if _, err := tb.Pick(a); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Pick(a); !errors.Is(err, ErrAtLimit) {
		t.Fatalf("second pick after a minute idle: %v; want ErrAtLimit (burst 1)", err)
	}
}

// TestIdleSitesAreDropped: the per-site state follows the sites in use,
// not every site ever seen.
func TestIdleSitesAreDropped(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 1, Rate: 1}})
	fill(tb, "demo", 2)
	var busy Proxy
	for i := range 1000 {
		x, err := tb.Pick(Target{Pool: "demo", Site: fmt.Sprintf("s%d.example", i)})
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			busy = x // still in flight at the end
			continue
		}
		tb.Done(x)
	}
	now = now.Add(2 * time.Second) // every bucket full again
	if _, err := tb.Pick(Target{Pool: "demo"}); err != nil {
		t.Fatal(err)
	}
	p := tb.pool("demo")
	p.mu.Lock()
	n := len(p.sites)
	_, kept := p.sites["s0.example"]
	p.mu.Unlock()
	if n != 1 || !kept {
		t.Fatalf("after the sweep %d sites are held (s0 with a request in flight: %v); want only s0", n, kept)
	}
	if _, err := tb.Pick(Target{Pool: "demo", Site: "s0.example"}); err != nil {
		t.Fatalf("the other proxy for s0: %v", err)
	}
	if _, err := tb.Pick(Target{Pool: "demo", Site: "s0.example"}); !errors.Is(err, ErrAtLimit) {
		t.Fatalf("s0's count was lost in the sweep: %v; want ErrAtLimit", err)
	}
	tb.Done(busy)
}

// TestAcquireWaits: Acquire waits for a proxy under its limits, up to the
// queue timeout, and stops with the context.
func TestAcquireWaits(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.SetSpec("demo", &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 1, QueueTimeout: events.Duration(200 * time.Millisecond)}})
	fill(tb, "demo", 1)
	a := Target{Pool: "demo", Site: "a.example"}
	held, err := tb.Acquire(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	// Past the queue timeout: the LimitError.
	if _, err := tb.Acquire(context.Background(), a); !errors.Is(err, ErrAtLimit) {
		t.Fatalf("Acquire with the proxy busy past the queue timeout: %v; want ErrAtLimit", err)
	}
	// The context ends first.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := tb.Acquire(ctx, a); !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire with a cancelled context: %v", err)
	}
	// A request's end wakes the waiter.
	tb.SetSpec("demo", &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 1, QueueTimeout: events.Duration(time.Minute)}})
	got := make(chan error, 1)
	go func() {
		x, err := tb.Acquire(context.Background(), a)
		if err == nil && x.ID != held.ID {
			err = fmt.Errorf("acquired %s", x.ID)
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Acquire returned while the only proxy was busy: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	tb.Done(held)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Acquire was not woken by the request's end")
	}
}

// TestSessionWaitsForItsProxy: a session whose proxy is at its limit for
// the site waits for it (a LimitError) rather than move.
func TestSessionWaitsForItsProxy(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.SetSpec("demo", &events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 1}})
	fill(tb, "demo", 2)
	s := Target{Pool: "demo", Session: "s", Site: "a.example"}
	first, err := tb.Pick(s)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Pick(s); !errors.Is(err, ErrAtLimit) {
		t.Fatalf("second request of the session while its proxy is busy: %v; want ErrAtLimit", err)
	}
	tb.Done(first)
	if x, err := tb.Pick(s); err != nil || x.ID != first.ID {
		t.Fatalf("session after its proxy freed: %v %v; want %s", x.ID, err, first.ID)
	}
}

// TestSessionRotatesAfterMaxRequests: with maxRequests 10, 30 uses of a
// session visit the 3 proxies in turn, 10 each.
func TestSessionRotatesAfterMaxRequests(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.SetSpec("demo", &events.GatewaySpec{Session: &events.SessionRotation{MaxRequests: 10}})
	fill(tb, "demo", 3)
	var order []string
	count := map[string]int{}
	for range 30 {
		x, err := tb.Pick(Target{Pool: "demo", Session: "s", Client: "c"})
		if err != nil {
			t.Fatal(err)
		}
		tb.Done(x)
		if len(order) == 0 || order[len(order)-1] != x.ID {
			order = append(order, x.ID)
		}
		count[x.ID]++
	}
	if len(order) != 3 || count[order[0]] != 10 || count[order[1]] != 10 || count[order[2]] != 10 {
		t.Fatalf("30 uses with maxRequests 10: visited %v, counts %v; want 3 proxies, 10 each", order, count)
	}
}

// TestSessionRotatesAfterMaxAge: a session moves once it has been on its
// proxy for maxAge, to another proxy; with one proxy it stays.
func TestSessionRotatesAfterMaxAge(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{Strategy: events.StrategyRandom, Session: &events.SessionRotation{MaxAge: events.Duration(time.Minute)}})
	fill(tb, "demo", 2)
	s := Target{Pool: "demo", Session: "s", Client: "c"}
	first, _ := tb.Pick(s)
	now = now.Add(59 * time.Second)
	if x, _ := tb.Pick(s); x.ID != first.ID {
		t.Fatalf("moved after 59s to %s", x.ID)
	}
	now = now.Add(time.Second)
	second, _ := tb.Pick(s)
	if second.ID == first.ID {
		t.Fatalf("still on %s after maxAge", first.ID)
	}
	now = now.Add(30 * time.Second)
	if x, _ := tb.Pick(s); x.ID != second.ID {
		t.Fatalf("moved 30s after its rotation, to %s", x.ID)
	}
	tb.Remove(first.ID)
	now = now.Add(time.Minute)
	if x, err := tb.Pick(s); err != nil || x.ID != second.ID {
		t.Fatalf("rotation with one proxy left: %v %v; want it to stay on %s", x.ID, err, second.ID)
	}
}

// TestApplySession: sessions shared by other gateways are served on their
// proxy, uses add up, the later pin wins, and expired ones are ignored.
func TestApplySession(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{SessionTTL: events.Duration(time.Minute), Session: &events.SessionRotation{MaxRequests: 5}})
	fill(tb, "demo", 3)
	type told struct {
		id    string
		moved bool
	}
	var hooks []told
	tb.SetSessionHook(func(pool, id string, moved bool) { hooks = append(hooks, told{id, moved}) })

	tb.ApplySession("demo", "r", SessionState{Proxy: "demo-2", Pinned: now.Add(-time.Second), Used: now.Add(-time.Second), Uses: 3})
	if x, _ := tb.Pick(Target{Pool: "demo", Session: "r", Client: "c"}); x.ID != "demo-2" {
		t.Fatalf("shared session served on %s, want demo-2", x.ID)
	}
	if st, ok := tb.TakeSession("demo", "r"); !ok || st.Uses != 4 || st.Proxy != "demo-2" {
		t.Fatalf("after one use here: %+v %v; want 4 uses on demo-2", st, ok)
	}
	// Another gateway's count (it saw 4 and used it twice) plus one more here.
	tb.Pick(Target{Pool: "demo", Session: "r", Client: "c"})
	tb.ApplySession("demo", "r", SessionState{Proxy: "demo-2", Pinned: now.Add(-time.Second), Used: now, Uses: 6})
	if st, _ := tb.TakeSession("demo", "r"); st.Uses != 7 {
		t.Fatalf("uses after merging: %d, want 7", st.Uses)
	}
	// An older pin loses and the hook is told to share this one again; a
	// later one wins.
	hooks = nil
	tb.ApplySession("demo", "r", SessionState{Proxy: "demo-0", Pinned: now.Add(-time.Hour), Used: now, Uses: 1})
	if st, _ := tb.TakeSession("demo", "r"); st.Proxy != "demo-2" || len(hooks) != 1 || !hooks[0].moved {
		t.Fatalf("older pin applied: %+v, hooks %v", st, hooks)
	}
	later := now.Add(time.Millisecond)
	tb.ApplySession("demo", "r", SessionState{Proxy: "demo-1", Pinned: later, Used: later, Uses: 1})
	if x, _ := tb.Pick(Target{Pool: "demo", Session: "r", Client: "c"}); x.ID != "demo-1" {
		t.Fatalf("after a later pin: %s, want demo-1", x.ID)
	}
	// Past its TTL: ignored.
	tb.ApplySession("demo", "old", SessionState{Proxy: "demo-1", Pinned: now.Add(-2 * time.Minute), Used: now.Add(-61 * time.Second), Uses: 1})
	if _, ok := tb.TakeSession("demo", "old"); ok {
		t.Fatal("an expired shared session was kept")
	}
	// Each use told the hook; a pin told it moved.
	hooks = nil
	tb.Pick(Target{Pool: "demo", Session: "new", Client: "c"})
	tb.Pick(Target{Pool: "demo", Session: "new", Client: "c"})
	if len(hooks) != 2 || !hooks[0].moved || hooks[1].moved {
		t.Fatalf("hooks of a pin and a use: %v", hooks)
	}
	// Without maxRequests a use is told only once the others' copy is a
	// quarter of the TTL old.
	tb.SetSpec("demo", &events.GatewaySpec{SessionTTL: events.Duration(time.Minute)})
	tb.TakeSession("demo", "new")
	hooks = nil
	tb.Pick(Target{Pool: "demo", Session: "new", Client: "c"})
	now = now.Add(14 * time.Second)
	tb.Pick(Target{Pool: "demo", Session: "new", Client: "c"})
	if len(hooks) != 0 {
		t.Fatalf("uses within a quarter of the TTL of the last share were told: %v", hooks)
	}
	now = now.Add(time.Second)
	tb.Pick(Target{Pool: "demo", Session: "new", Client: "c"})
	if len(hooks) != 1 || hooks[0].moved {
		t.Fatalf("a use a quarter of the TTL after the last share: hooks %v; want one use told", hooks)
	}
}
