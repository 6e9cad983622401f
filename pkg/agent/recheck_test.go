package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// kill changes what the backend reports of proxy id's instance behind the
// agent's back: terminated with detail, or gone when detail is "".
func (d *memDriver) kill(id, detail string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	name := events.InstanceName(id)
	if detail == "" {
		delete(d.instances, name)
		return
	}
	d.instances[name].State, d.instances[name].Detail, d.instances[name].Address = agent.StateTerminated, detail, ""
}

// waitSweeps waits until the runtime has listed the instances n more times.
func (d *memDriver) waitSweeps(t *testing.T, n int) {
	t.Helper()
	d.mu.Lock()
	want := d.lists + n
	d.mu.Unlock()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		d.mu.Lock()
		got := d.lists
		d.mu.Unlock()
		if got >= want {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("the runtime did not list its instances %d more times", n)
}

func (h *harness) observe(id, kind string, data any) {
	h.t.Helper()
	if _, err := h.store.Append(context.Background(), events.AggregateProxy, id, kind, id+"."+kind+".test", data, nil); err != nil {
		h.t.Fatal(err)
	}
}

func failedData(t *testing.T, evs []bus.Event) events.ProxyFailedData {
	t.Helper()
	var f events.ProxyFailedData
	if err := evs[len(evs)-1].DecodeData(&f); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestRecheckFailsProxyOfDeadInstance: a proxy that is up as far as the
// log knows gets failed (class terminated) once its instance terminates or
// disappears behind the agent's back, exactly once however many sweeps see
// it dead.
func TestRecheckFailsProxyOfDeadInstance(t *testing.T) {
	cases := []struct {
		name      string
		last      string // health's last word before the instance died
		detail    string // "" removes the instance
		wantInMsg string
	}{
		{"terminated while ready", events.ProxyReady, "process 123 is gone", "terminated: process 123 is gone"},
		{"terminated while unhealthy", events.ProxyUnhealthy, "domain is shut off", "terminated: domain is shut off"},
		{"terminated while running", "", "Pod phase Failed", "terminated: Pod phase Failed"},
		{"disappeared while ready", events.ProxyReady, "", "disappeared"},
	}
	d := newMemDriver()
	h := start(t, d)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := "dead-" + string(rune('a'+i))
			h.create(id, 1)
			h.waitFor(id, events.ProxyRunning)
			switch c.last {
			case events.ProxyReady:
				h.observe(id, c.last, events.ProxyReadyData{Address: "127.0.0.1:9"})
			case events.ProxyUnhealthy:
				h.observe(id, c.last, events.ProxyUnhealthyData{Reason: "probe failed", Streak: 3})
			}
			// At least one sweep sees the instance alive first, so a
			// disappearance can be told from never having been there.
			d.waitSweeps(t, 2)
			d.kill(id, c.detail)
			evs := h.waitFor(id, events.ProxyFailed)
			f := failedData(t, evs)
			name := events.InstanceName(id)
			if f.Class != events.ClassTerminated || f.Attempt != 1 || !strings.Contains(f.Reason, name) || !strings.Contains(f.Reason, c.wantInMsg) {
				t.Fatalf("failed = %+v; want class %s, attempt 1, reason naming %s and %q", f, events.ClassTerminated, name, c.wantInMsg)
			}
			d.waitSweeps(t, 3)
			evs, _ = h.store.Load(context.Background(), events.AggregateProxy, id)
			if n := count(evs, events.ProxyFailed); n != 1 {
				t.Fatalf("%d failed events after more sweeps, want 1: %v", n, kinds(evs))
			}
		})
	}
}

// TestRecheckLeavesOthersAlone: a dead instance whose proxy is not up as
// far as the log knows (still provisioning, retiring, already failed), or
// was placed by another target (whatever that target's agent claims),
// gets no failed event from the recheck.
func TestRecheckLeavesOthersAlone(t *testing.T) {
	d := newMemDriver()
	h := start(t, d)
	dead := func(id string) {
		d.mu.Lock()
		defer d.mu.Unlock()
		name := events.InstanceName(id)
		d.instances[name] = &agent.Instance{Name: name, Marker: agent.Marker{ProxyID: id, Pool: "p", Entry: "mem"}, State: agent.StateTerminated, Detail: "shut off"}
	}
	// An agent's observation, as the agent of target (of entry mem)
	// appends it, claiming claimed in its data.
	by := func(target, id, kind string, data any) {
		t.Helper()
		if _, err := bus.NewEventStore(h.conn, events.AgentSource("mem", target), nil).Append(context.Background(), events.AggregateProxy, id, kind, id+"."+kind+".test", data, nil); err != nil {
			t.Fatal(err)
		}
	}
	provBy := func(target, id, claimed string) {
		by(target, id, events.ProxyProvisioning, events.ProxyProvisioningData{Entry: "mem", Target: claimed, Instance: events.InstanceName(id), Attempt: 1})
	}
	prov := func(id, target string) { provBy(target, id, target) }
	running := events.ProxyRunningData{Address: "127.0.0.1:9", Attempt: 1}
	// Another target of the same entry placed this one.
	dead("other-target")
	prov("other-target", "t2")
	by("t2", "other-target", events.ProxyRunning, running)
	// Another agent claims, in its provisioning's data, that this agent
	// placed it: only this agent's own provisioning counts.
	dead("forged")
	provBy("t2", "forged", "t1")
	by("t2", "forged", events.ProxyRunning, running)
	// Being retired: the planner's delete decides.
	dead("retiring")
	prov("retiring", "t1")
	by("t1", "retiring", events.ProxyRunning, running)
	h.observe("retiring", events.ProxyRetiring, events.ProxyRetiringData{Reason: "scale down"})
	// Another entry's marker.
	d.mu.Lock()
	foreign := events.InstanceName("foreign")
	d.instances[foreign] = &agent.Instance{Name: foreign, Marker: agent.Marker{ProxyID: "foreign", Pool: "p", Entry: "other"}, State: agent.StateTerminated}
	d.mu.Unlock()
	prov("foreign", "t1")
	by("t1", "foreign", events.ProxyRunning, running)

	d.waitSweeps(t, 4)
	for _, id := range []string{"other-target", "forged", "retiring", "foreign"} {
		evs, err := h.store.Load(context.Background(), events.AggregateProxy, id)
		if err != nil {
			t.Fatal(err)
		}
		if n := count(evs, events.ProxyFailed); n != 0 {
			t.Errorf("proxy %s: recheck appended failed: %v", id, kinds(evs))
		}
	}
}

// TestRecheckDoesNotRaceCommands: a dead instance whose proxy has a command
// in flight is left to that command.
func TestRecheckDoesNotRaceCommands(t *testing.T) {
	d := newMemDriver()
	release := make(chan struct{})
	h := start(t, d)
	h.create("busy-1", 1)
	h.waitFor("busy-1", events.ProxyRunning)
	d.waitSweeps(t, 2)
	// A create for another attempt blocks in the driver, holding the
	// proxy's queue, while the instance is dead.
	d.mu.Lock()
	d.block = map[string]chan struct{}{"busy-1": release}
	d.mu.Unlock()
	h.observe("busy-1", events.ProxyProvisioning, events.ProxyProvisioningData{Entry: "mem", Target: "t1", Instance: events.InstanceName("busy-1"), Attempt: 2})
	h.create("busy-1", 2)
	waitCond(t, "the second create to block in the driver", func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.blocked["busy-1"]
	})
	// The log says running again (as a racing observation could), and the
	// instance dies: only the command in flight may decide.
	h.observe("busy-1", events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:9", Attempt: 2})
	d.kill("busy-1", "stopped")
	d.waitSweeps(t, 4)
	evs, _ := h.store.Load(context.Background(), events.AggregateProxy, "busy-1")
	if n := count(evs, events.ProxyFailed); n != 0 {
		t.Fatalf("recheck failed a proxy with a command in flight: %v", kinds(evs))
	}
	close(release) // the create then finds the instance terminated: its own outcome

	h.waitQueueEmpty()
}

func count(evs []bus.Event, kind string) int {
	n := 0
	for _, e := range evs {
		if e.Kind == kind {
			n++
		}
	}
	return n
}
