package planner

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// fakeGateway reports a pool's demand into fleet-demand as a gateway does,
// every second so its report stays fresh, until it stops.
type fakeGateway struct {
	h     *harness
	kv    jetstream.KeyValue
	key   string
	pool  string
	name  string
	conns atomic.Int64
	stop  func()
}

// newFakeGateway is a gateway reporting conns connections for pool that
// has reported nothing yet.
func (h *harness) newFakeGateway(pool, name string, conns int) *fakeGateway {
	h.t.Helper()
	kv, err := h.c.JS.KeyValue(context.Background(), bus.BucketDemand)
	if err != nil {
		h.t.Fatal(err)
	}
	g := &fakeGateway{h: h, kv: kv, key: events.DemandKey(pool, name), pool: pool, name: name}
	g.conns.Store(int64(conns))
	return g
}

func (h *harness) gateway(pool, name string, conns int) *fakeGateway {
	h.t.Helper()
	g := h.newFakeGateway(pool, name, conns)
	g.put(time.Now())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(time.Second)
		defer tk.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
				g.put(time.Now())
			}
		}
	}()
	var once sync.Once
	g.stop = func() { once.Do(func() { cancel(); <-done }) }
	h.t.Cleanup(g.stop)
	return g
}

// staleReport writes one report of conns connections for pool, taken at
// at, that nobody renews: a gateway gone long ago. It is never fresh, not
// even for an instant an autoscaling round could see.
func (h *harness) staleReport(pool, name string, conns int, at time.Time) {
	h.t.Helper()
	h.newFakeGateway(pool, name, conns).put(at)
}

func (g *fakeGateway) put(at time.Time) {
	d := events.GatewayDemand{Pool: g.pool, Gateway: g.name, Connections: int(g.conns.Load()), At: at.UTC()}
	b, _ := json.Marshal(d)
	if _, err := g.kv.Put(context.Background(), g.key, b); err != nil {
		g.h.t.Errorf("put demand %s: %v", g.key, err)
	}
}

func (g *fakeGateway) set(conns int) {
	g.conns.Store(int64(conns))
	g.put(time.Now())
}

// leave stops the gateway and removes its report, as a gateway that shuts
// down does.
func (g *fakeGateway) leave() {
	g.h.t.Helper()
	g.stop()
	if err := g.kv.Delete(context.Background(), g.key); err != nil {
		g.h.t.Fatal(err)
	}
}

// scaledEvents returns the pool.scaled events of pool, in order.
func (h *harness) scaledEvents(pool string) []events.PoolScaledData {
	h.t.Helper()
	var out []events.PoolScaledData
	for _, e := range h.eventsOf(events.AggregatePool, events.PoolScaled) {
		if e.ID != pool {
			continue
		}
		var d events.PoolScaledData
		if err := e.DecodeData(&d); err != nil {
			h.t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

// activeProxies counts the pool's proxies that count toward its size in
// the log: requested and not retiring.
func (h *harness) activeProxies(pool string) int {
	h.t.Helper()
	live := map[string]bool{}
	for _, e := range h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		switch e.Kind {
		case events.ProxyRequested:
			var d events.ProxyRequestedData
			if err := e.DecodeData(&d); err == nil && d.Pool == pool {
				live[e.ID] = true
			}
		case events.ProxyRetiring, events.ProxyFailed:
			delete(live, e.ID)
		}
	}
	return len(live)
}

// scaleClock is an autoscaling clock that stands still until the test
// moves it: a stretch of low demand ends only when the test says so,
// however slow the machine.
type scaleClock struct{ at atomic.Int64 }

func newScaleClock() *scaleClock {
	c := &scaleClock{}
	c.at.Store(time.Now().UnixNano())
	return c
}

func (c *scaleClock) now() time.Time { return time.Unix(0, c.at.Load()) }

func (c *scaleClock) advance(d time.Duration) { c.at.Add(int64(d)) }

// startScaler starts a leader whose autoscaling clock is clock.
func (h *harness) startScaler(id string, clock *scaleClock) *running {
	h.t.Helper()
	r := h.startPlannerWith(Config{ID: id, AutoscaleInterval: 50 * time.Millisecond}, nil, func(p *Planner) {
		p.scaleNow = clock.now
	})
	h.waitFor("leader "+id, r.IsLeader)
	return r
}

// scaleRounds waits until r has completed n more autoscaling rounds.
func (h *harness) scaleRounds(r *running, n int64) {
	h.t.Helper()
	from := r.scaleRounds.Load()
	h.waitFor("autoscaling rounds", func() bool { return r.scaleRounds.Load() >= from+n })
}

// demandSeen waits until r's autoscaler sees conns connections for pool.
func (h *harness) demandSeen(r *running, pool string, conns int) {
	h.t.Helper()
	h.waitFor("demand seen", func() bool {
		n, ok := r.demand.of(pool, time.Now())
		return ok && n == conns
	})
}

const autoscaled = `{"name":"web","provider":"local","size":3,"autoscale":{"min":2,"max":10,"targetConnections":4,"scaleDownAfter":"10s"}}`

// TestAutoscaleFollowsDemand: demand of 37 connections (two gateways;
// a stale report and another pool's demand do not count) at 4 per proxy
// grows the pool from 3 to its max of 10 at once, with an event saying
// why; once demand drops the pool keeps its size until demand stayed low
// for scaleDownAfter, then shrinks to the most that stretch asked for, and
// with no demand at all back to min.
func TestAutoscaleFollowsDemand(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	clock := newScaleClock()
	r := h.startScaler("p1", clock)
	h.ok(poolApply, autoscaled, nil)
	h.requested(3)
	var pv api.PoolView
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 3 || pv.ScaleReason != "" {
		t.Fatalf("before any demand: size %d, reason %q; want the starting size 3 and no reason", pv.Size, pv.ScaleReason)
	}

	// Reports that do not count, then 7 connections (2 proxies, fewer
	// than 3: nothing happens while the clock stands still), then 30 more.
	h.gateway("other", "g1", 100)
	h.staleReport("web", "g3", 100, time.Now().Add(-time.Minute))
	g2 := h.gateway("web", "g2", 7)
	h.demandSeen(r, "web", 7)
	g1 := h.gateway("web", "g1", 30)
	h.waitFor("scaled to 10", func() bool { return len(h.scaledEvents("web")) >= 1 })
	want := events.PoolScaledData{Size: 10, Previous: 3, Reason: "autoscale: 37 connections for 10 proxies"}
	if got := h.scaledEvents("web"); len(got) != 1 || got[0] != want {
		t.Fatalf("scaled events: got %+v, want [%+v]", got, want)
	}
	h.waitFor("10 proxies", func() bool { return h.activeProxies("web") == 10 })
	h.folded(r)
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 10 || pv.ScaleReason != want.Reason {
		t.Errorf("pool.get after scaling up: size %d, reason %q; want 10, %q", pv.Size, pv.ScaleReason, want.Reason)
	}

	// Demand falls to 13 (4 proxies), then 6, then stops: nothing
	// shrinks while the clock stands still.
	g1.set(6)
	h.demandSeen(r, "web", 13)
	h.scaleRounds(r, 2)
	g2.leave()
	h.demandSeen(r, "web", 6)
	h.scaleRounds(r, 2)
	g1.leave()
	h.demandSeen(r, "web", 0)
	h.scaleRounds(r, 3)
	if n := len(h.scaledEvents("web")); n != 1 {
		t.Fatalf("scaled events before scaleDownAfter: got %d, want 1", n)
	}
	if n := h.activeProxies("web"); n != 10 {
		t.Fatalf("proxies before scaleDownAfter: got %d, want 10", n)
	}

	// scaleDownAfter of low demand: down to the most that stretch asked
	// for (13 connections, 4 proxies).
	clock.advance(10 * time.Second)
	h.waitFor("scaled to 4", func() bool { return len(h.scaledEvents("web")) >= 2 })
	want = events.PoolScaledData{Size: 4, Previous: 10, Reason: "autoscale: 13 connections for 4 proxies after 10s of low demand"}
	if got := h.scaledEvents("web"); len(got) != 2 || got[1] != want {
		t.Fatalf("scaled events: got %+v, want the second %+v", got, want)
	}
	h.waitFor("4 proxies", func() bool { return h.activeProxies("web") == 4 })

	// No demand for another scaleDownAfter: back to min.
	h.scaleRounds(r, 2)
	clock.advance(10 * time.Second)
	h.waitFor("scaled to 2", func() bool { return len(h.scaledEvents("web")) >= 3 })
	want = events.PoolScaledData{Size: 2, Previous: 4, Reason: "autoscale: 0 connections for 2 proxies after 10s of low demand"}
	if got := h.scaledEvents("web"); len(got) != 3 || got[2] != want {
		t.Fatalf("scaled events: got %+v, want the third %+v", got, want)
	}
	h.waitFor("2 proxies", func() bool { return h.activeProxies("web") == 2 })
	h.folded(r)
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 2 || pv.ScaleReason != want.Reason {
		t.Errorf("pool.get after scaling down: size %d, reason %q; want 2, %q", pv.Size, pv.ScaleReason, want.Reason)
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
		var d events.ProxyRetiringData
		if err := e.DecodeData(&d); err != nil || d.Reason != "scaled down" {
			t.Errorf("retiring %s: reason %q (%v), want \"scaled down\"", e.ID, d.Reason, err)
		}
	}
}

// TestAutoscaleIgnoresPoolsWithoutIt: a pool without autoscale keeps its
// size whatever the demand, and nothing is scaled.
func TestAutoscaleIgnoresPoolsWithoutIt(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startScaler("p1", newScaleClock())
	h.ok(poolApply, `{"name":"plain","provider":"local","size":2}`, nil)
	h.requested(2)
	h.gateway("plain", "g1", 400)
	h.demandSeen(r, "plain", 400)
	h.scaleRounds(r, 5)
	h.settle(r, 3)
	if got := h.scaledEvents("plain"); len(got) != 0 {
		t.Fatalf("scaled events of a pool without autoscale: got %+v, want none", got)
	}
	if n := h.activeProxies("plain"); n != 2 {
		t.Fatalf("proxies: got %d, want its size 2", n)
	}
}

// TestAutoscaleSurvivesReapplyAndRestart: re-applying an autoscaled pool
// keeps the size autoscaling reached (clamped into new bounds) and rolls
// nothing; a restarted planner starts from the size the log holds and
// appends no second decision for the same demand; turning autoscale off
// returns the pool to its size.
func TestAutoscaleSurvivesReapplyAndRestart(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	clock := newScaleClock()
	r := h.startScaler("p1", clock)
	h.ok(poolApply, autoscaled, nil)
	h.requested(3)
	h.gateway("web", "g1", 37)
	h.waitFor("scaled to 10", func() bool { return len(h.scaledEvents("web")) == 1 })
	h.waitFor("10 proxies", func() bool { return h.activeProxies("web") == 10 })

	// The same pool with another maxAge: still 10, nothing retired or
	// rolled.
	var pv api.PoolView
	h.ok(poolApply, `{"name":"web","provider":"local","size":3,"maxAge":"1h","autoscale":{"min":2,"max":10,"targetConnections":4,"scaleDownAfter":"10s"}}`, &pv)
	if pv.Size != 10 || pv.Revision != 2 {
		t.Fatalf("re-applied: size %d at revision %d, want 10 at 2", pv.Size, pv.Revision)
	}
	h.settle(r, 3)
	h.scaleRounds(r, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Fatalf("retiring after a re-apply: got %d, want 0", n)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 10 {
		t.Fatalf("requested after a re-apply: got %d, want 10 (no roll)", n)
	}

	// A lower max clamps the size at once: 8, and two retired.
	h.ok(poolApply, `{"name":"web","provider":"local","size":3,"maxAge":"1h","autoscale":{"min":2,"max":8,"targetConnections":4,"scaleDownAfter":"10s"}}`, &pv)
	if pv.Size != 8 || pv.Outdated != 0 {
		t.Fatalf("re-applied with max 8: size %d, outdated %d; want 8, 0", pv.Size, pv.Outdated)
	}
	h.waitFor("8 proxies", func() bool { return h.activeProxies("web") == 8 })
	if n := len(h.scaledEvents("web")); n != 1 {
		t.Fatalf("scaled events after the re-applies: got %d, want 1", n)
	}

	// A restarted planner (demand unchanged) starts from 8 and decides
	// nothing new.
	r.stop()
	clock.advance(time.Hour)
	r = h.startScaler("p2", clock)
	h.folded(r)
	h.demandSeen(r, "web", 37)
	h.scaleRounds(r, 5)
	h.settle(r, 3)
	if got := h.scaledEvents("web"); len(got) != 1 {
		t.Fatalf("scaled events after a restart: got %+v, want the one from before", got)
	}
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 8 {
		t.Fatalf("size after a restart: got %d, want 8", pv.Size)
	}
	if n := h.activeProxies("web"); n != 8 {
		t.Fatalf("proxies after a restart: got %d, want 8", n)
	}

	// Autoscale off: back to size 3.
	pv = api.PoolView{}
	h.ok(poolApply, `{"name":"web","provider":"local","size":3,"maxAge":"1h"}`, &pv)
	if pv.Size != 3 || pv.ScaleReason != "" {
		t.Fatalf("autoscale off: size %d, reason %q; want 3 and none", pv.Size, pv.ScaleReason)
	}
	h.waitFor("3 proxies", func() bool { return h.activeProxies("web") == 3 })
	h.scaleRounds(r, 3)
	if n := len(h.scaledEvents("web")); n != 1 {
		t.Fatalf("scaled events after autoscale was turned off: got %d, want 1", n)
	}
}
