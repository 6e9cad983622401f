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
