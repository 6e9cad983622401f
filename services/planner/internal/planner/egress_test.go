package planner

import (
	"reflect"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// TestPoolEgressReachesCommands: a pool's egress allowance is shown by
// pool.get and carried by every create command; changing it is a new
// revision.
func TestPoolEgressReachesCommands(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	want := &events.Egress{AllowCIDRs: []string{"10.1.0.0/16", "fd12::/16"}, AllowPorts: []int{8080, 8443}}
	var pv api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2,"egress":{"allowCIDRs":["10.1.0.0/16","fd12::/16"],"allowPorts":[8080,8443]}}`, &pv)
	if !reflect.DeepEqual(pv.Spec.Egress, want) {
		t.Fatalf("apply reply egress: got %+v, want %+v", pv.Spec.Egress, want)
	}
	h.ok(poolGet, `{"name":"demo"}`, &pv)
	if !reflect.DeepEqual(pv.Spec.Egress, want) {
		t.Fatalf("pool.get egress: got %+v, want %+v", pv.Spec.Egress, want)
	}
	_, req := h.requested(2)
	for id, d := range req {
		if !reflect.DeepEqual(d.Egress, want) {
			t.Errorf("requested %s egress: got %+v, want %+v", id, d.Egress, want)
		}
	}
	var creates []command
	h.waitFor("2 create commands", func() bool { creates = h.commandsOf(events.VerbCreate); return len(creates) >= 2 })
	for _, c := range creates {
		if !reflect.DeepEqual(c.Create.Egress, want) {
			t.Errorf("create %s egress: got %+v, want %+v", c.Create.ProxyID, c.Create.Egress, want)
		}
	}
	var changed api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2,"egress":{"allowPorts":[8080]}}`, &changed)
	if changed.Revision != 2 || changed.ShapeRevision != 2 || !reflect.DeepEqual(changed.Spec.Egress, &events.Egress{AllowPorts: []int{8080}}) {
		t.Errorf("changing egress: revision %d, shape revision %d, egress %+v; want 2, 2 (the pool rolls), ports [8080]", changed.Revision, changed.ShapeRevision, changed.Spec.Egress)
	}
	// An empty allowance is no allowance.
	var empty, none api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2,"egress":{}}`, &empty)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, &none)
	if empty.Revision != 3 || none.Revision != 3 || none.Spec.Egress != nil || empty.Spec.Egress != nil {
		t.Errorf("empty egress then none: revisions %d and %d, egress %+v; want one revision 3 without egress", empty.Revision, none.Revision, none.Spec.Egress)
	}
}
