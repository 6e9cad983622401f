package e2e_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

var (
	failpointOnce sync.Once
	failpointErr  error
)

// failpointPlanner builds the planner with its test failpoints compiled in
// (-tags failpoint) and returns the binary's path.
func failpointPlanner(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(binDir, "planner-failpoint")
	failpointOnce.Do(func() {
		if err := goBuild(bin, "-tags", serviceTags+",failpoint", "proxyfleet/services/planner/cmd/planner"); err != nil {
			failpointErr = fmt.Errorf("build planner with failpoints: %v", err)
		}
	})
	if failpointErr != nil {
		t.Fatal(failpointErr)
	}
	return bin
}

// startPlannerAs starts the planner binary bin as replica id with the extra
// environment env, logging to planner-<id>.log; the fleet's cleanup stops
// it.
func (f *fleet) startPlannerAs(bin, id string, env ...string) *exec.Cmd {
	f.t.Helper()
	return f.startBinary("planner-"+id, bin, env, "--id", id, "--reconcile-interval", "200ms")
}

// isStopped reports whether process pid is stopped by a signal.
func isStopped(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the parenthesised command name.
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] == 'T'
}

// TestPausedLeaderIsFenced is the acceptance test of leader fencing: two
// planner processes; the leader stops (SIGSTOP) in the middle of a round of
// creates, past its lease, at the worst moment: after its lease check and
// right before it publishes a decision (a failpoint compiled into this
// test's planner binary raises the SIGSTOP there). The other replica takes
// over and fills the pool; then the stale leader gets SIGCONT and publishes
// the decision it was about to — the create of a new proxy, which no
// aggregate expectation can stop. The pool must never hold more than
// size+1 active proxies, and no decision of the stale leader may be in the
// log after the other replica's term began.
func TestPausedLeaderIsFenced(t *testing.T) {
	f := newFleet(t)
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, n := range []string{"planner-a", "planner-b", "local-agent"} {
			l := f.log(n)
			if len(l) > 8000 {
				l = l[len(l)-8000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})
	ctx := context.Background()
	store := bus.NewEventStore(f.conn, "e2e", nil)
	termOf := func(leader string) func() bool {
		return func() bool {
			cur, err := store.CurrentTerm(ctx)
			return err == nil && cur != nil && cur.Leader == leader
		}
	}
	// requested counts the proxies of the pool requested so far, by leader.
	requested := func() map[string]int {
		n := map[string]int{}
		_ = store.Replay(ctx, 0, func(e bus.Event) error {
			if e.Aggregate == events.AggregateProxy && e.Kind == events.ProxyRequested {
				if _, leader, ok := e.Leader(); ok {
					n[leader]++
				}
			}
			return nil
		})
		return n
	}

	const size = 8
	// a stops itself before its third decision: two creates in.
	a := f.startPlannerAs(failpointPlanner(t), "a", "PF_FAILPOINT_STOP_BEFORE_DECISION=3")
	var resumeOnce sync.Once
	resume := func() { resumeOnce.Do(func() { _ = a.Process.Signal(syscall.SIGCONT) }) }
	t.Cleanup(resume) // a stopped process would not stop on SIGTERM
	waitFor(t, 30*time.Second, "planner a to lead", termOf("a"))
	f.startHealth()
	f.startAgent()
	f.waitAgent("local", "t1")
	f.startPlannerAs(filepath.Join(binDir, "planner"), "b")

	f.apply(events.PoolSpec{Name: "fence", Provider: "local", Size: 8})
	waitFor(t, 30*time.Second, "planner a to stop before a decision", func() bool { return isStopped(a.Process.Pid) })
	waitFor(t, 30*time.Second, "planner b to take over", termOf("b"))
	bTerm, err := store.CurrentTerm(ctx)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "planner b to fill the pool", func() bool {
		n := requested()
		return n["a"]+n["b"] >= size
	})
	byA := requested()["a"]

	// While a is stopped, the operator recycles one proxy and reports
	// another banned. The deciding endpoints are the leader's alone: the
	// server may still route a request to the subscription stopped a holds,
	// where it waits (the request times out here) until a resumes; what a
	// then decides from its stale view must land nothing.
	waitFor(t, 30*time.Second, "two proxies of the pool in fleet-proxies", func() bool { return len(f.proxies("fence")) >= 2 })
	var ids []string
	for _, v := range f.proxies("fence") {
		ids = append(ids, v.ID)
	}
	var answered []string
	for i, r := range []struct{ subject, body string }{
		{"fleet.api.proxy.recycle", `{"id":"` + ids[0] + `"}`},
		{"fleet.api.proxy.report-ban", `{"id":"` + ids[1] + `","reason":"403 while a was stopped"}`},
		{"fleet.api.proxy.recycle", `{"id":"` + ids[0] + `"}`},
		{"fleet.api.proxy.report-ban", `{"id":"` + ids[1] + `","reason":"403 while a was stopped"}`},
	} {
		reply, err := f.conn.NC.Request(r.subject, []byte(r.body), 3*time.Second)
		switch {
		case err != nil:
			t.Logf("request %d (%s) not answered while a is stopped: %v", i, r.subject, err)
		default:
			answered = append(answered, r.subject+" "+reply.Header.Get("Nats-Service-Error-Code"))
		}
	}
	t.Logf("answered while a was stopped: %v", answered)
	resume()

	// The stale leader notices and stops deciding.
	waitFor(t, 30*time.Second, "planner a to stop reconciling", func() bool {
		return strings.Contains(f.log("planner-a"), "no longer reconciling")
	})
	f.waitPool("fence", size, "ready", 90*time.Second)
	// Let the resumed replica run beside the leader a little longer.
	time.Sleep(3 * time.Second)

	// Read the whole log.
	var stale []string
	state := map[string]string{} // proxy id → its state in the lifecycle
	maxActive := 0
	var history []string // every proxy event, for a failure's message
	active := func() int {
		n := 0
		for _, s := range state {
			switch s {
			case events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
				n++
			}
		}
		return n
	}
	if err := store.Replay(ctx, 0, func(e bus.Event) error {
		if term, leader, ok := e.Leader(); ok && leader == "a" && e.Seq > bTerm.Seq {
			stale = append(stale, e.Subject+" ("+e.Kind+", term "+strconv.FormatUint(term, 10)+", seq "+strconv.FormatUint(e.Seq, 10)+")")
		}
		if e.Aggregate != events.AggregateProxy {
			return nil
		}
		if _, known := state[e.ID]; known || e.Kind == events.ProxyRequested {
			// Through the lifecycle, as the planner and health fold it: an
			// agent's running recorded after the proxy was retired (its
			// create was under way when the ban came) does not make it
			// active again.
			state[e.ID], _ = events.Transition(state[e.ID], e.Kind)
			maxActive = max(maxActive, active())
			_, leader, _ := e.Leader()
			history = append(history, fmt.Sprintf("seq %d %s %s by %q (active %d): %s", e.Seq, e.ID, e.Kind, leader, active(), e.Envelope.Data))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(stale) > 0 {
		t.Errorf("decisions of the deposed leader a appended after b's term began (seq %d):\n  %s", bTerm.Seq, strings.Join(stale, "\n  "))
	}
	if maxActive > size+1 {
		t.Errorf("the pool held %d active proxies at one point; want at most size+1 = %d; the proxies' events:\n  %s",
			maxActive, size+1, strings.Join(history, "\n  "))
	}
	if !termOf("b")() {
		t.Errorf("b no longer holds the latest term")
	}
	if strings.Contains(f.log("planner-a"), "proxy retired by operator") {
		t.Errorf("the deposed leader a retired a proxy for the operator")
	}
	t.Logf("a requested %d of %d proxies before it was stopped; b's term began at seq %d; most active proxies in the log: %d", byA, size, bTerm.Seq, maxActive)
	for _, l := range strings.Split(f.log("planner-a"), "\n") {
		if strings.Contains(l, "reconciling") || strings.Contains(l, "deposed") || strings.Contains(l, "refused") || strings.Contains(l, "failpoint") {
			t.Logf("planner a: %s", l)
		}
	}
}
