package e2e_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// TestKilledProxyIsReplaced is the fleet healing a dead proxy: kill -9 of
// one proxy process of a ready pool of 3 → the local agent's recheck finds
// the process gone and records failed (class terminated), the planner
// retires it and requests a replacement, the agent deletes it; within
// unhealthyAfter + 30 s the pool has 3 ready proxies again, the dead one's
// events end deleted, and no process or state of it is left.
func TestKilledProxyIsReplaced(t *testing.T) {
	const unhealthyAfter = 10 * time.Second
	f := startFleet(t)
	f.apply(events.PoolSpec{Name: "heal", Provider: "local", Size: 3, UnhealthyAfter: events.Duration(unhealthyAfter)})
	ready := f.waitPool("heal", 3, "ready", 60*time.Second)
	victim := ready[0]
	pid := f.statePID(victim.ID)
	if !slices.Contains(f.proxyProcs(), pid) {
		t.Fatalf("proxy %s: pid %d from its state is not one of the proxy processes %v", victim.ID, pid, f.proxyProcs())
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()

	failedSubject := events.ObservationFilter(victim.ID, events.ProxyFailed) // the agent's
	waitFor(t, unhealthyAfter+30*time.Second, "the dead proxy's failed event", func() bool {
		return f.eventCount(failedSubject) > 0
	})
	var env struct {
		Time time.Time              `json:"time"`
		Data events.ProxyFailedData `json:"data"`
	}
	if err := json.Unmarshal(lastEventOf(t, f, failedSubject).Data, &env); err != nil {
		t.Fatal(err)
	}
	if env.Data.Class != events.ClassTerminated || !strings.Contains(env.Data.Reason, "is gone") {
		t.Fatalf("failed = %+v, want class %s naming the gone process", env.Data, events.ClassTerminated)
	}
	t.Logf("proxy %s: failed (%s) %.1fs after kill -9", victim.ID, env.Data.Reason, env.Time.Sub(killed).Seconds())

	waitFor(t, unhealthyAfter+30*time.Second-time.Since(killed), "3 ready proxies without the dead one", func() bool {
		ps := f.proxies("heal")
		if len(ps) != 3 {
			return false
		}
		for _, p := range ps {
			if p.ID == victim.ID || p.State != "ready" {
				return false
			}
		}
		return true
	})
	t.Logf("pool heal: 3 ready again %.1fs after kill -9", time.Since(killed).Seconds())

	deleted := events.ObservationFilter(victim.ID, events.ProxyDeleted)
	waitFor(t, 30*time.Second, "the dead proxy's deleted event", func() bool { return f.eventCount(deleted) > 0 })
	if n := f.eventCount(events.EventSubject(events.AggregateProxy, victim.ID, events.ProxyRetiring)); n != 1 {
		t.Fatalf("dead proxy has %d retiring events, want 1", n)
	}
	if n := len(f.proxyProcs()); n != 3 {
		t.Fatalf("%d proxy processes run, want 3", n)
	}
	if _, err := os.Stat(filepath.Join(f.stateDir, events.InstanceName(victim.ID)+".json")); !os.IsNotExist(err) {
		t.Fatalf("state of the dead proxy is left in the agent's state directory (stat: %v)", err)
	}
	states, _ := filepath.Glob(filepath.Join(f.stateDir, "*.json"))
	if len(states) != 3 {
		t.Fatalf("state files %v, want the 3 live proxies'", states)
	}
}

// statePID reads the pid the local agent recorded for proxy id.
func (f *fleet) statePID(id string) int {
	f.t.Helper()
	b, err := os.ReadFile(filepath.Join(f.stateDir, events.InstanceName(id)+".json"))
	if err != nil {
		f.t.Fatal(err)
	}
	var s struct {
		PID int `json:"pid"`
	}
	if err := json.Unmarshal(b, &s); err != nil || s.PID <= 0 {
		f.t.Fatalf("state of %s: pid %d, %v", id, s.PID, err)
	}
	return s.PID
}
