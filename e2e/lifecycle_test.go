package e2e_test

import (
	"context"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestPoolLifecycle is the walking skeleton's acceptance: a pool of 3 on the
// local backend becomes ready and carries HTTP; scaling to 1 retires two
// whose processes are gone; deleting the pool leaves nothing.
func TestPoolLifecycle(t *testing.T) {
	poolLifecycle(t, newFleet(t))
}

// TestPoolLifecycleSquid is the same flow with every proxy a real Squid
// process. It runs in the Squid tier (make test-e2e-squid), which installs
// Debian's squid and sets PROXYFLEET_SQUID.
func TestPoolLifecycleSquid(t *testing.T) {
	poolLifecycle(t, newSquidFleet(t))
}

func poolLifecycle(t *testing.T, f *fleet) {
	f.dumpLogsOnFailure()
	// The origin is on loopback, which the proxies refuse unless the agent
	// allows it.
	org := origin(t)
	f.allow(org)
	f.startAll()

	f.apply(events.PoolSpec{Name: "demo", Provider: "local", Size: 3})
	ready := f.waitPool("demo", 3, "ready", 60*time.Second)
	for _, p := range ready {
		code, body, err := getThrough(p.Address, org.URL, nil)
		if err != nil || code != 200 || !strings.HasPrefix(body, "hello through") {
			t.Fatalf("GET through %s (%s): %d %q %v", p.ID, p.Address, code, body, err)
		}
	}
	if n := len(f.proxyProcs()); n != 3 {
		t.Fatalf("%d proxy processes run, want 3", n)
	}

	f.apply(events.PoolSpec{Name: "demo", Provider: "local", Size: 1})
	left := f.waitPool("demo", 1, "ready", 60*time.Second)
	waitFor(t, 30*time.Second, "two proxy processes to exit", func() bool {
		return len(f.proxyProcs()) == 1
	})
	if code, _, err := getThrough(left[0].Address, org.URL, nil); err != nil || code != 200 {
		t.Fatalf("the remaining proxy stopped working: %d %v", code, err)
	}
	for _, p := range ready {
		if p.ID == left[0].ID {
			continue
		}
		if _, _, err := getThrough(p.Address, org.URL, nil); err == nil {
			t.Fatalf("retired proxy %s still answers at %s", p.ID, p.Address)
		}
	}

	f.deletePoolAndWait("demo")
}

// TestAgentKilledMidCreate kills the local-agent with SIGKILL while it is
// creating proxies and starts it again: exactly the pool's size runs, with
// no duplicate and no orphan process.
func TestAgentKilledMidCreate(t *testing.T) {
	f := startFleet(t)

	f.apply(events.PoolSpec{Name: "crash", Provider: "local", Size: 3})
	waitFor(t, 30*time.Second, "a provisioning event", func() bool {
		return f.eventCount("fleet.evt.proxy.*.provisioning.>") > 0
	})
	f.kill9("local-agent")
	f.startAgent()

	f.waitPool("crash", 3, "ready", 90*time.Second)
	if n := len(f.proxyProcs()); n != 3 {
		t.Fatalf("%d proxy processes after the crash, want 3", n)
	}
	if n := f.eventCount("fleet.evt.proxy.*.requested"); n != 3 {
		t.Fatalf("%d proxies requested, want 3 (a crash must not cause replacements)", n)
	}
	f.deletePoolAndWait("crash")
}

// TestPlannerRestartEmitsNoDuplicates restarts the planner after the pool
// converged: its state is rebuilt from the log and it publishes no command
// and decides nothing new.
func TestPlannerRestartEmitsNoDuplicates(t *testing.T) {
	f := startFleet(t)
	f.apply(events.PoolSpec{Name: "steady", Provider: "local", Size: 2})
	f.waitPool("steady", 2, "ready", 60*time.Second)

	cmds := f.lastSeq(bus.CommandsStream)
	requested := f.eventCount("fleet.evt.proxy.*.requested")
	f.stop("planner")
	f.startPlanner()
	// The restarted planner answers from state rebuilt by replay.
	waitFor(t, 30*time.Second, "the restarted planner to list 2 proxies", func() bool {
		n := 0
		for _, err := range f.api.ProxyList(context.Background(), api.ProxyListRequest{Pool: "steady"}) {
			if err != nil {
				return false
			}
			n++
		}
		return n == 2
	})
	// Give it several reconcile rounds (200ms each) to misbehave.
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if got := f.lastSeq(bus.CommandsStream); got != cmds {
			t.Fatalf("FLEET_CMDS last sequence moved from %d to %d after a planner restart", cmds, got)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := f.eventCount("fleet.evt.proxy.*.requested"); got != requested {
		t.Fatalf("requested events went from %d to %d after a planner restart", requested, got)
	}
	f.deletePoolAndWait("steady")
}

// TestTraceIDFlowsToObservations sets a W3C traceparent on the API request
// and finds its trace id on the agent's observation of the created proxy;
// the health service's ready transition, found by its probes later, is not
// in the request's trace (it starts a trace of its own, linked to the
// request: docs/observability.md#traces-and-logs).
func TestTraceIDFlowsToObservations(t *testing.T) {
	f := startFleet(t)
	var tid [16]byte
	copy(tid[:], []byte("proxyfleet-trace"))
	traceID := hex.EncodeToString(tid[:])
	hdr := nats.Header{}
	hdr.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	r := f.req("fleet.api.pool.apply", `{"name":"traced","provider":"local","size":1}`, hdr)
	if r.Code != "" {
		t.Fatalf("apply: %s %s", r.Code, r.Data)
	}
	f.waitPool("traced", 1, "ready", 60*time.Second)
	// The agent's observation continues the operator's trace.
	running := lastEventOf(t, f, "fleet.evt.proxy.*.running.>")
	if got := running.Header.Get("traceparent"); !strings.Contains(got, traceID) {
		t.Fatalf("running event traceparent = %q, want trace id %s", got, traceID)
	}
	// Health's transition does not.
	ready := lastEventOf(t, f, "fleet.evt.proxy.*.ready")
	if got := ready.Header.Get("traceparent"); strings.Contains(got, traceID) {
		t.Fatalf("ready event traceparent = %q: the transition was appended to the request's trace %s", got, traceID)
	}
	f.deletePool("traced")
	waitFor(t, 60*time.Second, "pool traced to be empty", func() bool { return len(f.proxies("traced")) == 0 })
}
