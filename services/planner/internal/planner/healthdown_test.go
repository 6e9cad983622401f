package planner

import (
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// failedEvents counts the failed events of proxy id.
func (h *harness) failedEvents(id string) int {
	n := 0
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
		if e.ID == id {
			n++
		}
	}
	return n
}

// healthUnavailableEvents counts the condition events of pool saying
// health is unavailable.
func (h *harness) healthUnavailableEvents(pool string) int {
	n := 0
	for _, e := range h.eventsOf(events.AggregatePool, events.PoolCondition) {
		var d events.PoolConditionData
		if e.ID == pool && e.DecodeData(&d) == nil && d.Reason == events.ReasonHealthUnavailable {
			n++
		}
	}
	return n
}

// TestHealthUnavailableSuspendsReadyTimeout: while no health replica is
// alive, every pool's Ready condition is Unknown with reason
// HealthUnavailable, and a proxy running past the ready timeout is not
// failed (nobody could probe it); once health is back the condition
// returns and the proxy gets a fresh ready timeout from then, rather than
// failing at once. A planner that starts while health is alive never
// reports it unavailable.
func TestHealthUnavailableSuspendsReadyTimeout(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	const readyTimeout = 1500 * time.Millisecond
	r := h.startPlannerWith(Config{ID: "blind", ReadyTimeout: readyTimeout}, nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"blind","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]
	h.waitCondition("blind", events.ConditionReady, events.ConditionFalse, events.ReasonNotEnoughReady, 5*time.Second)
	h.settle(r, 3)
	if n := h.healthUnavailableEvents("blind"); n != 0 {
		t.Fatalf("health unavailable reported %d times while a health replica was alive", n)
	}

	h.healthDown(false)
	c := h.waitCondition("blind", events.ConditionReady, events.ConditionUnknown, events.ReasonHealthUnavailable, 10*time.Second)
	if !strings.Contains(c.Message, "no health replica is alive since ") || !strings.Contains(c.Message, "readiness unknown") {
		t.Errorf("Ready message: got %q, want it to say since when no health replica is alive and that readiness is unknown", c.Message)
	}
	h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1})
	h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
	// Twice the ready timeout without health: nothing fails.
	time.Sleep(2 * readyTimeout)
	h.settle(r, 3)
	if n := h.failedEvents(id); n != 0 {
		t.Fatalf("a running proxy failed %d times while no health replica was alive to probe it", n)
	}

	h.healthUp()
	back := time.Now()
	h.waitCondition("blind", events.ConditionReady, events.ConditionFalse, events.ReasonNotEnoughReady, 10*time.Second)
	var failed events.ProxyFailedData
	h.waitFor("the proxy to fail once the fresh ready timeout ran out", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
			if e.ID == id && e.DecodeData(&failed) == nil {
				return true
			}
		}
		return false
	})
	if since := time.Since(back); since < readyTimeout {
		t.Errorf("the proxy failed %s after health came back, before the ready timeout of %s", since, readyTimeout)
	}
	if failed.Class != events.ClassTimeout || !strings.HasPrefix(failed.Reason, decide.NotReadyPrefix) {
		t.Errorf("failed: got %+v, want class timeout, a not-ready reason", failed)
	}
}

// TestHealthExpiredIsUnavailable: a health replica that dies leaves its
// key to expire (no marker to watch); the planner still notices.
func TestHealthExpiredIsUnavailable(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	h.ok(poolApply, `{"name":"dead","provider":"local","size":1}`, nil)
	h.requested(1)
	h.waitCondition("dead", events.ConditionReady, events.ConditionFalse, events.ReasonNotEnoughReady, 5*time.Second)
	h.healthDown(true)
	h.waitCondition("dead", events.ConditionReady, events.ConditionUnknown, events.ReasonHealthUnavailable, 15*time.Second)
}
