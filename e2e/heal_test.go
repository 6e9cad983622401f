package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// pidListeningOn returns the proxy process of this fleet whose --listen
// port is the port of addr.
func (f *fleet) pidListeningOn(addr string) int {
	f.t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		f.t.Fatalf("address %q: %v", addr, err)
	}
	for _, pid := range f.proxyProcs() {
		if listenPort(procArgs(pid)) == port {
			return pid
		}
	}
	f.t.Fatalf("no proxy process listens on %s", addr)
	return 0
}

// TestStoppedProxyIsReplaced: a proxy process that still exists but no
// longer answers (SIGSTOP) turns unhealthy; past the pool's unhealthyAfter
// a replacement is made, and once it is ready the stopped proxy is retired
// with its last probe error, deleted, and its process is gone. The pool
// holds 3 ready proxies within unhealthyAfter + 30 s of the proxy turning
// unhealthy.
func TestStoppedProxyIsReplaced(t *testing.T) {
	f := startFleet(t)
	const unhealthyAfter = 10 * time.Second
	f.apply(events.PoolSpec{Name: "sick", Provider: "local", Size: 3, UnhealthyAfter: events.Duration(10 * time.Second)})
	ready := f.waitPool("sick", 3, "ready", 60*time.Second)
	victim := ready[0]
	pid := f.pidListeningOn(victim.Address)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL); _ = syscall.Kill(pid, syscall.SIGCONT) })
	stopped := time.Now()

	// Health needs a few failed probes (each up to its timeout) to call it
	// unhealthy; from then on the pool's unhealthyAfter applies.
	waitFor(t, 60*time.Second, "the stopped proxy to turn unhealthy", func() bool {
		for _, p := range f.proxies("sick") {
			if p.ID == victim.ID {
				return p.State == "unhealthy"
			}
		}
		return false
	})
	unhealthyAt := time.Now()
	waitFor(t, unhealthyAfter+30*time.Second, "3 ready proxies without the stopped one", func() bool {
		n := 0
		for _, p := range f.proxies("sick") {
			if p.ID == victim.ID {
				return false
			}
			if p.State == "ready" {
				n++
			}
		}
		return n == 3
	})
	took := time.Since(stopped)
	ret := lastEventOf(t, f, events.EventSubject(events.AggregateProxy, victim.ID, events.ProxyRetiring))
	var rd events.ProxyRetiringData
	env, err := events.DecodeEnvelope(ret.Data)
	if err != nil || env.DecodeData(&rd) != nil {
		t.Fatalf("retiring event: %s", ret.Data)
	}
	if !strings.HasPrefix(rd.Reason, "unhealthy: ") {
		t.Errorf("retiring reason: got %q, want unhealthy: <last probe error>", rd.Reason)
	}
	lastEventOf(t, f, events.ObservationFilter(victim.ID, events.ProxyDeleted))
	waitFor(t, 10*time.Second, "the stopped proxy's process to be gone", func() bool {
		for _, p := range f.proxyProcs() {
			if p == pid {
				return false
			}
		}
		return true
	})
	if n := len(f.proxyProcs()); n != 3 {
		t.Errorf("proxy processes: got %d, want 3", n)
	}
	t.Logf("stopped proxy replaced %s after SIGSTOP (unhealthy seen after %s; unhealthyAfter %s)",
		took.Round(100*time.Millisecond), unhealthyAt.Sub(stopped).Round(100*time.Millisecond), unhealthyAfter)
}

// procArgs returns the command line of process pid, split into arguments.
func procArgs(pid int) [][]byte {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return bytes.Split(b, []byte{0})
}

// poolConditions is the conditions part of pool.get's answer.
type poolConditions struct {
	Conditions []events.Condition `json:"conditions"`
}

// TestPoolSaysWhyItCannotBePlaced: on the real local agent, which offers no
// image, a pool asking for one shows Placed=False NoTargetOffersImage in
// pool.get within 5 s; re-applied without the image it turns True and
// fills.
func TestPoolSaysWhyItCannotBePlaced(t *testing.T) {
	f := startFleet(t)
	f.apply(events.PoolSpec{Name: "img", Provider: "local", Size: 2, Image: "none-offers-this"})
	placed := func() events.Condition {
		pc := must(t, "pool.get img", func(ctx context.Context) (api.PoolView, error) { return f.api.PoolGet(ctx, "img") })
		c, _ := events.FindCondition(pc.Conditions, events.ConditionPlaced)
		return c
	}
	var c events.Condition
	waitFor(t, 5*time.Second, "Placed=False NoTargetOffersImage", func() bool {
		c = placed()
		return c.Status == events.ConditionFalse && c.Reason == events.ReasonNoTargetOffersImage
	})
	if !strings.Contains(c.Message, "none-offers-this") || !strings.Contains(c.Message, "t1") {
		t.Errorf("message %q does not name the image and the target", c.Message)
	}
	f.apply(events.PoolSpec{Name: "img", Provider: "local", Size: 2})
	waitFor(t, 10*time.Second, "Placed=True", func() bool {
		c = placed()
		return c.Status == events.ConditionTrue && c.Reason == events.ReasonPlaced
	})
	f.waitPool("img", 2, "ready", 60*time.Second)
	// The view carries the same conditions.
	waitFor(t, 10*time.Second, "fleet-pools with Ready=True", func() bool {
		var pc poolConditions
		if err := json.Unmarshal(f.views("fleet-pools")["img"], &pc); err != nil {
			return false
		}
		r, ok := events.FindCondition(pc.Conditions, events.ConditionReady)
		return ok && r.Status == events.ConditionTrue
	})
}
