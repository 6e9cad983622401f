package planner

import (
	"strconv"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

// TestLargeRoundDecidesEveryProxyOnce: a pool filled in one round with
// more decisions than one fenced batch carries gets every proxy requested
// exactly once, spread over the targets, with one create command each;
// later rounds add nothing.
func TestLargeRoundDecidesEveryProxyOnce(t *testing.T) {
	const size = 3*batchDecisions + 17
	h := newHarness(t)
	for _, tg := range []string{"t1", "t2", "t3"} {
		h.agent(agent.Info{Entry: "local", Target: tg})
	}
	r := h.leader()
	h.ok(poolApply, `{"name":"big","provider":"local","size":`+strconv.Itoa(size)+`}`, nil)
	ids, req := h.requested(size)
	h.waitFor("a create per proxy", func() bool { return len(h.commandsOf(events.VerbCreate)) >= size })
	h.settle(r, 3)
	if _, again := h.requested(size); len(again) != size {
		t.Fatalf("requested after more rounds: %d, want %d", len(again), size)
	}
	perTarget := map[string]int{}
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			t.Fatalf("proxy %s requested twice", id)
		}
		seen[id] = true
		perTarget[req[id].Target]++
	}
	for tg, n := range perTarget {
		if n < size/3-1 || n > size/3+1 {
			t.Errorf("target %s holds %d proxies, want %d±1 (spread)", tg, n, size/3)
		}
	}
	creates := h.commandsOf(events.VerbCreate)
	if len(creates) != size {
		t.Fatalf("create commands: got %d, want %d", len(creates), size)
	}
	for _, c := range creates {
		if !seen[c.Create.ProxyID] || c.Create.Attempt != 1 || c.Create.Target != req[c.Create.ProxyID].Target {
			t.Fatalf("create %+v matches no requested proxy", c.Create)
		}
	}
	if v := r.poolView("big"); v.Active != size || v.States[events.ProxyRequested] != size {
		t.Errorf("pool: %+v, want %d requested", v, size)
	}
}

// TestRoundsLookOnlyAtChangedPools: once a fleet of pools settled, a round
// looks at no pool at all, and an event about one proxy has the next
// rounds look at its pool alone.
func TestRoundsLookOnlyAtChangedPools(t *testing.T) {
	const pools = 20
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	for i := range pools {
		h.ok(poolApply, `{"name":"p`+strconv.Itoa(i)+`","provider":"local","size":1}`, nil)
	}
	ids, req := h.requested(pools)
	for _, id := range ids {
		h.bringUp(id, req[id].Target, events.ProxyReady)
	}
	h.waitFor("every pool ready", func() bool {
		for i := range pools {
			if c, ok := h.condition("p"+strconv.Itoa(i), events.ConditionReady); !ok || c.Status != events.ConditionTrue {
				return false
			}
		}
		return true
	})
	h.folded(r)
	h.settle(r, 3)
	before := r.looked.Load()
	h.settle(r, 10)
	if n := r.looked.Load() - before; n != 0 {
		t.Errorf("pools looked at by 10 rounds of a settled fleet: %d, want 0", n)
	}

	before = r.looked.Load()
	h.observe(ids[7], events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "probe: timeout", Streak: 3})
	h.waitFor("the pool's Ready condition to turn", func() bool {
		c, ok := h.condition(req[ids[7]].Pool, events.ConditionReady)
		return ok && c.Status == events.ConditionFalse
	})
	h.folded(r)
	h.settle(r, 10)
	// The unhealthy event, then the condition the leader recorded: the
	// pool looked at once or twice, no other pool.
	if n := r.looked.Load() - before; n < 1 || n > 3 {
		t.Errorf("pools looked at after one proxy turned unhealthy: %d, want 1 to 3 (its pool alone)", n)
	}
}
