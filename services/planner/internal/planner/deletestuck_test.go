package planner

import (
	"context"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// TestStuckDeleteShowsAConditionAndAGauge: a retiring proxy whose delete
// keeps failing (re-issued StuckDeletes times, its agent recording the
// failure) turns its pool's Cleanup condition False with reason
// DeleteStuck, naming the proxy, its target, since when it retires and
// the agent's last failure; the gauge proxyfleet_planner_deletes_stuck
// counts it. Once the proxy is deleted the condition turns True and the
// gauge 0.
func TestStuckDeleteShowsAConditionAndAGauge(t *testing.T) {
	ctx := context.Background()
	tel, err := telemetry.Setup(ctx, telemetry.Config{Service: "planner-test", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Close(context.Background()) })
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlannerMeasured(Config{ID: "stuck", RetireTimeout: 300 * time.Millisecond, StuckDeletes: 2}, nil, tel.Meter)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]
	h.scrapeUntil(tel.MetricsAddr, "the gauge at 0", func(m scraped) bool {
		return m.is(`proxyfleet_planner_deletes_stuck{pool="demo"}`, 0)
	})

	h.ok(poolApply, `{"name":"demo","provider":"local","size":0}`, nil)
	h.waitFor("its delete", func() bool { return len(h.commandsOf(events.VerbDelete)) >= 1 })
	// The agent fails the delete (its backend refuses), every time.
	h.observe(id, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "volume busy"})
	c := h.waitCondition("demo", events.ConditionCleanup, events.ConditionFalse, events.ReasonDeleteStuck, 15*time.Second)
	for _, want := range []string{id + " on local/t1", "retiring since ", "last failure: permanent: volume busy"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("Cleanup message %q does not say %q", c.Message, want)
		}
	}
	reissued := false
	for _, cmd := range h.commandsOf(events.VerbDelete) {
		reissued = reissued || cmd.Delete.ProxyID == id && cmd.Delete.Attempt >= 3
	}
	if !reissued {
		t.Errorf("Cleanup turned False before the delete was re-issued StuckDeletes (2) times")
	}
	h.scrapeUntil(tel.MetricsAddr, "the gauge at 1", func(m scraped) bool {
		return m.is(`proxyfleet_planner_deletes_stuck{pool="demo"}`, 1)
	})

	h.observe(id, events.ProxyDeleted, 1, events.ProxyDeletedData{})
	h.waitCondition("demo", events.ConditionCleanup, events.ConditionTrue, events.ReasonCleanedUp, 15*time.Second)
	h.scrapeUntil(tel.MetricsAddr, "the gauge back at 0", func(m scraped) bool {
		return m.is(`proxyfleet_planner_deletes_stuck{pool="demo"}`, 0)
	})
}
