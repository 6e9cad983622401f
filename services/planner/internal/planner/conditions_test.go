package planner

import (
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// condition returns the pool's condition of type typ as pool.get answers.
func (h *harness) condition(pool, typ string) (events.Condition, bool) {
	h.t.Helper()
	var v api.PoolView
	h.ok(poolGet, `{"name":"`+pool+`"}`, &v)
	return events.FindCondition(v.Conditions, typ)
}

// waitCondition waits until pool.get shows the condition with status and
// reason, and returns it.
func (h *harness) waitCondition(pool, typ, status, reason string, within time.Duration) events.Condition {
	h.t.Helper()
	deadline := time.Now().Add(within)
	for {
		c, ok := h.condition(pool, typ)
		if ok && c.Status == status && c.Reason == reason {
			return c
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("pool %s: condition %s is %+v, want %s with reason %s within %s", pool, typ, c, status, reason, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// conditionEvents counts the condition events of pool.
func (h *harness) conditionEvents(pool string) int {
	n := 0
	for _, e := range h.eventsOf(events.AggregatePool, events.PoolCondition) {
		if e.ID == pool {
			n++
		}
	}
	return n
}

// TestPlacedConditionSaysWhy: a pool asking for an image no target offers
// says so in pool.get within 5 s, naming the targets considered; a re-apply
// without the image turns Placed True and the pool fills.
func TestPlacedConditionSaysWhy(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Images: []string{"debian-12"}})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.startPlannerWith(Config{ID: "cond", ReconcileInterval: 2 * time.Second}, nil)
	h.waitFor("leader", r.IsLeader)
	d := &driver{h: h, done: map[string]bool{}}

	h.ok(poolApply, `{"name":"img","provider":"local","size":2,"image":"none-offers-this"}`, nil)
	c := h.waitCondition("img", events.ConditionPlaced, events.ConditionFalse, events.ReasonNoTargetOffersImage, 5*time.Second)
	for _, want := range []string{"none-offers-this", "t1 (offers debian-12)", "t2 (offers nothing)"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("Placed message %q does not name %q", c.Message, want)
		}
	}
	if rc, _ := h.condition("img", events.ConditionReady); rc.Status != events.ConditionFalse || rc.Reason != events.ReasonNotEnoughReady {
		t.Errorf("Ready: got %+v, want False NotEnoughReady", rc)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 0 {
		t.Fatalf("requested: got %d, want 0", n)
	}
	// Transitions only: rounds that find the same reason append nothing.
	n := h.conditionEvents("img")
	h.settle(r, 3)
	if got := h.conditionEvents("img"); got != n {
		t.Errorf("condition events while nothing changed: got %d, want %d", got, n)
	}

	h.ok(poolApply, `{"name":"img","provider":"local","size":2}`, nil)
	placed := h.waitCondition("img", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 10*time.Second)
	if !placed.Since.After(c.Since) {
		t.Errorf("Placed since: got %s, want after %s (the status changed)", placed.Since, c.Since)
	}
	h.waitFor("pool ready", func() bool {
		d.step()
		rc, _ := h.condition("img", events.ConditionReady)
		return rc.Status == events.ConditionTrue
	})
	h.waitCondition("img", events.ConditionProgressing, events.ConditionFalse, events.ReasonSettled, 10*time.Second)
}

// TestPlacedConditionReasons: no live target, a full target and a target
// in quota backoff each give their own reason.
func TestPlacedConditionReasons(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Capacity: 1})
	h.agent(agent.Info{Entry: "other", Target: "o1"})
	r := h.startPlannerWith(Config{ID: "why"}, nil)
	h.waitFor("leader", r.IsLeader)

	// Capacity: one slot on the only target.
	h.ok(poolApply, `{"name":"full","provider":"local","size":2}`, nil)
	c := h.waitCondition("full", events.ConditionPlaced, events.ConditionFalse, events.ReasonCapacityExhausted, 10*time.Second)
	if !strings.Contains(c.Message, "t1 (1 of 1)") {
		t.Errorf("CapacityExhausted message %q does not name t1 (1 of 1)", c.Message)
	}

	// Quota: the target answered quota a moment ago.
	h.ok(poolApply, `{"name":"q","provider":"other","size":2}`, nil)
	var first string
	h.waitFor("a proxy of q", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
			if strings.HasPrefix(e.ID, "q-") {
				first = e.ID
			}
		}
		return first != ""
	})
	h.observe(first, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassQuota, Reason: "QUOTA_EXCEEDED", Attempt: 1})
	c = h.waitCondition("q", events.ConditionPlaced, events.ConditionFalse, events.ReasonQuota, 10*time.Second)
	if !strings.Contains(c.Message, "o1 (quota at") {
		t.Errorf("Quota message %q does not name o1", c.Message)
	}

	// No live target: the only agent of the entry went away.
	h.goneAgent("local", "t1")
	h.ok(poolApply, `{"name":"full","provider":"local","size":3}`, nil)
	c = h.waitCondition("full", events.ConditionPlaced, events.ConditionFalse, events.ReasonNoLiveTarget, 10*time.Second)
	if !strings.Contains(c.Message, "t1") {
		t.Errorf("NoLiveTarget message %q does not name t1", c.Message)
	}
}
