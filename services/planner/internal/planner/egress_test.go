package planner

import (
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// TestDistinctEgressReplacesTheNewer: in a pool with distinctEgress, two
// members that health found egressing from one address (their ready
// events) are one too many: the newer is replaced, the replacement's
// requested event saying why (shared-egress), and retired once the
// replacement is ready.
func TestDistinctEgressReplacesTheNewer(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	h.ok(poolApply, `{"name":"apart","provider":"local","size":2,"distinctEgress":true}`, nil)
	ids, _ := h.requested(2)
	for _, id := range ids {
		h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1})
		h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000", EgressIP: "192.0.2.7"})
	}
	all, req := h.requested(3)
	repl := all[2]
	d := req[repl]
	if d.Replaces != ids[0] && d.Replaces != ids[1] || !strings.HasPrefix(d.ReplaceReason, decide.SharedEgressPrefix+": egress 192.0.2.7") {
		t.Fatalf("replacement: got replaces %q for %q, want one of %v for a shared egress", d.Replaces, d.ReplaceReason, ids)
	}
	kept := ids[0]
	if d.Replaces == ids[0] {
		kept = ids[1]
	}
	if !strings.Contains(d.ReplaceReason, kept) {
		t.Errorf("reason %q does not name the member kept (%s)", d.ReplaceReason, kept)
	}
	h.observe(repl, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(repl), Attempt: 1})
	h.observe(repl, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4001", Attempt: 1})
	h.observe(repl, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4001", EgressIP: "192.0.2.8"})
	h.waitFor("the shared one retired", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
			var r events.ProxyRetiringData
			if e.ID == d.Replaces && e.DecodeData(&r) == nil && strings.HasPrefix(r.Reason, decide.SharedEgressPrefix) {
				return true
			}
		}
		return false
	})
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
		if e.ID == kept {
			t.Fatalf("the older member %s was retired", kept)
		}
	}
}
