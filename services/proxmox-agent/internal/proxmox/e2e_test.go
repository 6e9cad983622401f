package proxmox_test

import (
	"strconv"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/proxmox-agent/internal/proxmox"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// runAgent runs a pkg/agent runtime with d until the returned stop is
// called (stop waits for Run to return).
func (e *env) runAgent(d *proxmox.Driver) (stop func()) {
	e.t.Helper()
	rt, err := agent.New(e.conn, d, agent.Config{
		Info:          agent.Info{Entry: entry, Target: node, Type: "proxmox", Images: e.cfg.ImageKeys(), Profiles: e.cfg.ProfileNames()},
		WatchInterval: 5 * time.Millisecond, CommandTimeout: time.Minute, HeartbeatInterval: time.Second,
	}, nil, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	_, stopRun := agenttest.Serve(e.t, rt.Run)
	return func() {
		if err := stopRun(); err != nil {
			e.t.Errorf("agent Run: %v", err)
		}
	}
}

func createCmd(proxy string) events.CreateCommand {
	return events.CreateCommand{
		ProxyID:   proxy,
		ProxySpec: events.ProxySpec{Pool: "web", Entry: entry, Target: node, Instance: events.InstanceName(proxy), Revision: 1, Image: "debian-13", Profile: "small", Port: 3128},
		Attempt:   1,
		Auth:      &events.ProxyAuth{Username: "u", Password: "secret-pw"},
	}
}

func TestEndToEndCreateAndDeleteThroughTheRuntime(t *testing.T) {
	e := newEnv(t, pvetest.Options{NextIDAsString: true})
	e.runAgent(e.driver())
	ctx := ctxT(t, 60*time.Second)
	store := bus.NewEventStore(e.conn, "test", nil)

	proxies := []string{"web-e2e0000001", "web-e2e0000002", "web-e2e0000003"}
	for _, p := range proxies {
		if _, err := bus.PublishCreate(ctx, e.conn, "test", createCmd(p), 0); err != nil {
			t.Fatal(err)
		}
	}
	providerIDs := map[string]string{}
	for _, p := range proxies {
		ev := e.waitEvent(ctx, store, p, events.ProxyRunning)
		var run events.ProxyRunningData
		if err := ev.DecodeData(&run); err != nil {
			t.Fatal(err)
		}
		vmid, err := strconv.Atoi(run.ProviderID)
		if err != nil {
			t.Fatalf("running provider ID %q is not a VMID", run.ProviderID)
		}
		if want := pvetest.GuestAddress(vmid) + ":3128"; run.Address != want {
			t.Errorf("%s address = %q, want %q from the guest agent", p, run.Address, want)
		}
		// The VMID was recorded in a provisioning event before the clone.
		all, err := store.Load(ctx, events.AggregateProxy, p)
		if err != nil {
			t.Fatal(err)
		}
		var prov events.ProxyProvisioningData
		if len(all) < 2 || all[0].Kind != events.ProxyProvisioning || all[0].DecodeData(&prov) != nil || prov.ProviderID != run.ProviderID {
			t.Errorf("%s events do not start with provisioning carrying VMID %s: %+v", p, run.ProviderID, prov)
		}
		providerIDs[p] = run.ProviderID
	}
	if got := len(e.fake.VMs()); got != len(proxies) {
		t.Fatalf("%d VMs, want %d", got, len(proxies))
	}

	for _, p := range proxies {
		cmd := events.DeleteCommand{ProxyID: p, Pool: "web", Entry: entry, Target: node, Instance: events.InstanceName(p),
			ProviderID: providerIDs[p], Attempt: 1, Reason: "pool deleted"}
		if _, err := bus.PublishDelete(ctx, e.conn, "test", cmd, 0); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range proxies {
		e.waitEvent(ctx, store, p, events.ProxyDeleted)
	}
	if vms := e.fake.VMs(); len(vms) != 0 {
		t.Errorf("VMs left: %+v", vms)
	}
	if seeds := e.fake.Volumes(node, "proxy-seeds"); len(seeds) != 0 {
		t.Errorf("seeds left: %v", seeds)
	}
	if keys := e.reservations(); len(keys) != 0 {
		t.Errorf("VMID reservations left: %v", keys)
	}
}

// TestAgentCrashDuringCloneThenRestart: the agent dies after the clone task
// started and before running was published; the restarted agent gets the
// command again and finishes that clone instead of making a second one.
func TestAgentCrashDuringCloneThenRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the command's ack deadline")
	}
	e := newEnv(t, pvetest.Options{TaskTicks: 40})
	stop := e.runAgent(e.driver())
	ctx := ctxT(t, 90*time.Second)
	store := bus.NewEventStore(e.conn, "test", nil)
	const p = "web-crash00001"
	if _, err := bus.PublishCreate(ctx, e.conn, "test", createCmd(p), 0); err != nil {
		t.Fatal(err)
	}
	for e.fake.Clones() == 0 {
		select {
		case <-ctx.Done():
			t.Fatal("the clone never started")
		case <-time.After(time.Millisecond):
		}
	}
	stop() // the crash: the command is neither acknowledged nor retried
	last, err := store.Last(ctx, events.AggregateProxy, p)
	if err != nil || last == nil || last.Kind != events.ProxyProvisioning {
		t.Fatalf("after the crash the last event is %+v (%v), want provisioning", last, err)
	}
	var prov events.ProxyProvisioningData
	if err := last.DecodeData(&prov); err != nil || prov.ProviderID == "" {
		t.Fatalf("provisioning event carries no VMID: %+v %v", prov, err)
	}

	e.runAgent(e.driver())
	ev := e.waitEvent(ctx, store, p, events.ProxyRunning)
	var run events.ProxyRunningData
	_ = ev.DecodeData(&run)
	if run.ProviderID != prov.ProviderID {
		t.Errorf("running on VMID %s, want the recorded %s", run.ProviderID, prov.ProviderID)
	}
	if c := e.fake.Clones(); c != 1 {
		t.Errorf("clones = %d, want 1", c)
	}
	e.wantOneVM(p)
}
