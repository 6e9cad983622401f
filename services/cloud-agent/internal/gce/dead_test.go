package gce

import (
	"testing"

	"proxyfleet/pkg/agent"
)

// stopBehindTheBack stops an instance through the API, as an operator,
// a preemption or a host event would, and waits for its operation.
func stopBehindTheBack(t *testing.T, d *Driver, zone, name string) {
	t.Helper()
	op, err := d.svc.Instances.Stop(d.o.Config.Project, zone, name).Context(ctx(t)).Do()
	if err != nil {
		t.Fatalf("stop %s: %v", name, err)
	}
	if err := d.wait(ctx(t), zone, op); err != nil {
		t.Fatalf("stop %s: %v", name, err)
	}
}

// TestStoppedInstanceIsTerminated: an instance stopped behind the agent's
// back is TERMINATED on the API and terminated in Get and List, with the
// status in the detail.
func TestStoppedInstanceIsTerminated(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", []string{"zone-a"}, nil)
	s := spec("px-stopped", 1)
	ref := createRunning(t, d, s)
	stopBehindTheBack(t, d, "zone-a", s.Name)
	got, err := d.Get(ctx(t), ref)
	if err != nil || got.State != agent.StateTerminated || got.Detail != "instance is TERMINATED" || got.Address != "" {
		t.Errorf("Get = %+v, %v; want terminated, instance is TERMINATED, no address", got, err)
	}
	list, err := d.List(ctx(t))
	if err != nil || len(list) != 1 || list[0].State != agent.StateTerminated || list[0].Detail != "instance is TERMINATED" {
		t.Errorf("List = %+v, %v; want one terminated, instance is TERMINATED", list, err)
	}
}
