package planner

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// driver plays agent and health service for a rotation test: it brings up
// every requested proxy to ready and reports every retiring one deleted.
type driver struct {
	h    *harness
	done map[string]bool
}

func (d *driver) step() {
	for _, e := range d.h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		key := e.ID + "/" + e.Kind
		if d.done[key] {
			continue
		}
		switch e.Kind {
		case events.ProxyRequested:
			var rd events.ProxyRequestedData
			if err := e.DecodeData(&rd); err != nil {
				d.h.t.Fatal(err)
			}
			d.h.bringUp(e.ID, rd.Target, events.ProxyReady)
		case events.ProxyRetiring:
			d.h.observe(e.ID, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
		}
		d.done[key] = true
	}
}

// TestRotationIsSurgeFirst: with the rotation clock moved past maxAge,
// every proxy of a pool with maxAge is replaced, one surge proxy at a time,
// and the pool never has fewer than size ready proxies once it had them; a
// pool without maxAge is never rotated.
func TestRotationIsSurgeFirst(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	var skew atomic.Int64
	r := h.startPlannerWith(Config{ID: "rot"}, nil, func(p *Planner) {
		p.ageNow = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	})
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"rot","provider":"local","size":2,"maxAge":"1m"}`, nil)
	h.ok(poolApply, `{"name":"steady","provider":"local","size":1}`, nil)
	d := &driver{h: h, done: map[string]bool{}}
	originals, req := h.requested(3)
	h.waitFor("3 ready", func() bool {
		d.step()
		return r.poolView("rot").States[events.ProxyReady] == 2 && r.poolView("steady").States[events.ProxyReady] == 1
	})
	// Younger than maxAge: nothing rotates.
	h.settle(r, 5)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Fatalf("retiring before maxAge: got %d, want 0", n)
	}

	// Every proxy is now older than maxAge plus any jitter.
	skew.Store(int64(2 * time.Minute))
	rotated := map[string]string{}
	h.waitFor("the originals rotated", func() bool {
		d.step()
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
			var rd events.ProxyRetiringData
			_ = e.DecodeData(&rd)
			rotated[e.ID] = rd.Reason
		}
		n := 0
		for _, id := range originals {
			if req[id].Pool == "rot" && rotated[id] != "" {
				n++
			}
		}
		return n == 2
	})
	skew.Store(0)
	h.waitFor("rotation over", func() bool {
		d.step()
		v := r.poolView("rot")
		return v.Active == 2 && v.States[events.ProxyReady] == 2 && v.States[events.ProxyRetiring] == 0
	})

	for _, id := range originals {
		switch req[id].Pool {
		case "rot":
			if !strings.HasPrefix(rotated[id], "rotated: ") {
				t.Errorf("original %s: retiring reason %q, want a rotation", id, rotated[id])
			}
		case "steady":
			if why, ok := rotated[id]; ok {
				t.Errorf("proxy %s of the pool without maxAge retired: %q", id, why)
			}
		}
	}

	// Fold the log: the rotating pool never had more than size+1 active
	// proxies, nor fewer than size ready once it had size, and every proxy
	// it created during the rotation names the one it replaces.
	state := map[string]string{}
	pool := map[string]string{}
	readyOnce := false
	for _, e := range h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		if e.Kind == events.ProxyRequested {
			var rd events.ProxyRequestedData
			_ = e.DecodeData(&rd)
			pool[e.ID] = rd.Pool
			if rd.Pool == "rot" && !contains(originals, e.ID) && rd.Replaces == "" {
				t.Errorf("replacement %s (seq %d) names no proxy it replaces", e.ID, e.Seq)
			}
		}
		if pool[e.ID] != "rot" {
			continue
		}
		switch e.Kind {
		case events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
			// As the planner folds them: progress moves active proxies only.
			if decide.IsActive(state[e.ID]) {
				state[e.ID] = e.Kind
			}
		default:
			state[e.ID] = e.Kind
		}
		active, ready := 0, 0
		for _, s := range state {
			if decide.IsActive(s) {
				active++
			}
			if s == events.ProxyReady {
				ready++
			}
		}
		if active > 3 {
			t.Errorf("seq %d: %d active proxies, want at most size+1 = 3", e.Seq, active)
		}
		if ready >= 2 {
			readyOnce = true
		} else if readyOnce {
			t.Errorf("seq %d (%s %s): %d ready proxies, want at least size = 2", e.Seq, e.ID, e.Kind, ready)
		}
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyFailed)); n != 0 {
		t.Errorf("failed events: got %d, want 0", n)
	}
	if got := h.lastSeq(bus.CommandsStream); got == 0 {
		t.Error("no commands published")
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
