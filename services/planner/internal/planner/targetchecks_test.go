package planner

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// putCheck writes a target's check record into fleet-targets as health's
// target checker does, taken at at.
func (h *harness) putCheck(target string, at time.Time, failing ...agent.Verdict) {
	h.t.Helper()
	kv, err := h.c.JS.KeyValue(context.Background(), bus.BucketTargets)
	if err != nil {
		h.t.Fatal(err)
	}
	rec := agent.TargetCheck{Entry: "local", Target: target, OK: len(failing) == 0, At: at.UTC(),
		Verdicts: append([]agent.Verdict{{Check: "version", OK: true}}, failing...)}
	b, _ := json.Marshal(rec)
	if _, err := kv.Put(context.Background(), agent.HeartbeatKey("local", target), b); err != nil {
		h.t.Fatal(err)
	}
}

// TestPlacementSkipsTargetsFailingChecks: a target whose latest check in
// fleet-targets fails takes no new proxy; when every target fails, the
// pool's Placed condition says TargetsUnhealthy, naming the targets and
// their failing checks; a target that passes again fills the pool, and a
// failed record too old to trust (health down) blocks nothing.
func TestPlacementSkipsTargetsFailingChecks(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	notRunning := agent.Verdict{Check: "pool", OK: false, Detail: "not running"}
	h.putCheck("t1", time.Now(), notRunning)
	h.putCheck("t2", time.Now())
	r := h.startPlannerWith(Config{ID: "checks", CheckMaxAge: time.Minute}, nil)
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"spread","provider":"local","size":2}`, nil)
	_, req := h.requested(2)
	for id, d := range req {
		if d.Target != "t2" {
			t.Errorf("proxy %s placed on %s, whose check fails; want t2", id, d.Target)
		}
	}

	h.putCheck("t2", time.Now(), agent.Verdict{Check: "disk", OK: false, Detail: "1% free"})
	h.ok(poolApply, `{"name":"stuck","provider":"local","size":1}`, nil)
	c := h.waitCondition("stuck", events.ConditionPlaced, events.ConditionFalse, events.ReasonTargetsUnhealthy, 10*time.Second)
	for _, want := range []string{"t1 (pool: not running)", "t2 (disk: 1% free)"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("Placed message %q does not name %q", c.Message, want)
		}
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 2 {
		t.Fatalf("requested: got %d, want the 2 of pool spread alone", n)
	}

	h.putCheck("t1", time.Now())
	h.waitCondition("stuck", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 10*time.Second)
	_, req = h.requested(3)
	for id, d := range req {
		if d.Pool == "stuck" && d.Target != "t1" {
			t.Errorf("proxy %s placed on %s, whose check fails; want t1", id, d.Target)
		}
	}

	// Records older than CheckMaxAge: health stopped checking; they no
	// longer keep proxies off.
	h.putCheck("t1", time.Now().Add(-2*time.Minute), notRunning)
	h.putCheck("t2", time.Now().Add(-2*time.Minute), notRunning)
	h.ok(poolApply, `{"name":"stale","provider":"local","size":1}`, nil)
	h.requested(4)
}
