package planner

import (
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
)

// fakeInventory answers the inventory requests of one target the way
// pkg/agent's fleet-agent service does, with a list the test changes. A
// silent one counts the requests and never answers, so they time out.
type fakeInventory struct {
	silent bool

	mu       sync.Mutex
	list     []agent.Instance
	requests int
}

func (h *harness) fakeInventory(entry, target string, silent bool) *fakeInventory {
	h.t.Helper()
	f := &fakeInventory{silent: silent}
	sub, err := h.c.NC.Subscribe(events.AgentSubject(entry, target, events.AgentInventory), func(m *nats.Msg) {
		f.mu.Lock()
		f.requests++
		list := append([]agent.Instance{}, f.list...)
		f.mu.Unlock()
		if f.silent {
			return
		}
		// Pages of at most two instances, so every walk takes several.
		var req page.Request
		if err := json.Unmarshal(m.Data, &req); err != nil {
			h.t.Errorf("inventory request %q: %v", m.Data, err)
			return
		}
		limit := min(req.Limit, 2)
		name := func(i agent.Instance) string { return i.Name }
		b, err := page.Encode("instances", page.FirstAfter(slices.Values(list), name, req.After, limit+1), name, limit, 1<<20)
		if err != nil {
			h.t.Errorf("inventory page: %v", err)
			return
		}
		_ = m.Respond(b)
	})
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = sub.Unsubscribe() })
	return f
}

func (f *fakeInventory) add(insts ...agent.Instance) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.list = append(f.list, insts...)
}

func (f *fakeInventory) asked() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests
}

// marked is the instance an agent of entry lists for proxy id of pool.
func marked(id, pool, entry string) agent.Instance {
	return agent.Instance{Name: events.InstanceName(id), ProviderID: "pid-" + id,
		Marker: agent.Marker{ProxyID: id, Pool: pool, Entry: entry}, State: agent.StateRunning}
}

// gcSettle waits until r has completed n more garbage-collection rounds.
func (h *harness) gcSettle(r *running, n int64) {
	h.t.Helper()
	from := r.gcRounds.Load()
	h.waitFor("garbage-collection rounds", func() bool { return r.gcRounds.Load() >= from+n })
}

const (
	testGCGrace    = 1500 * time.Millisecond
	testGCInterval = 100 * time.Millisecond
)

func gcConfig(id string) Config {
	return Config{ID: id, GCInterval: testGCInterval, GCGrace: testGCGrace, InventoryTimeout: 300 * time.Millisecond}
}

// TestGCDeletesOrphansAfterGrace: an instance whose proxy the planner never
// knew is deleted once it has been orphaned for longer than the grace,
// with one retiring event and one delete command however many rounds see
// it; the instances of live and abandoned proxies, of another entry and
// unmarked ones are never touched, and a proxy on a target whose inventory
// times out is left alone.
func TestGCDeletesOrphansAfterGrace(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	t1 := h.fakeInventory("local", "t1", false)
	t2 := h.fakeInventory("local", "t2", true)
	r := h.startPlannerWith(gcConfig("gc"), nil)
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"demo","provider":"local","targets":["t1"],"size":2}`, nil)
	ids, _ := h.requested(2)
	t1.add(marked(ids[0], "demo", "local"), marked(ids[1], "demo", "local"))
	h.bringUp(ids[0], "t1", events.ProxyReady)
	h.bringUp(ids[1], "t1", events.ProxyReady)
	// ids[1] is abandoned: its instance stays, on purpose.
	h.ok(proxyDelete, `{"id":"`+ids[1]+`","skipCleanup":true}`, nil)
	ids, _ = h.requested(3)
	t1.add(marked(ids[2], "demo", "local"))
	h.bringUp(ids[2], "t1", events.ProxyReady)
	// A pool on t2, whose agent never answers an inventory request.
	h.ok(poolApply, `{"name":"quiet","provider":"local","targets":["t2"],"size":1}`, nil)
	all, req := h.requested(4)
	quiet := all[3]
	if req[quiet].Target != "t2" {
		t.Fatalf("quiet proxy on %s, want t2", req[quiet].Target)
	}
	h.bringUp(quiet, "t2", events.ProxyReady)

	ghost := events.NewProxyID("demo")
	foreign := marked(events.NewProxyID("demo"), "demo", "gce")
	unmarked := agent.Instance{Name: "someone-elses-vm", State: agent.StateRunning}
	added := time.Now()
	t1.add(marked(ghost, "demo", "local"), foreign, unmarked)

	var del command
	h.waitFor("delete of the orphan", func() bool {
		for _, c := range h.commandsOf(events.VerbDelete) {
			if c.Delete.ProxyID == ghost {
				del = c
				return true
			}
		}
		return false
	})
	if min := added.Add(testGCGrace); del.Time.Before(min) {
		t.Errorf("orphan deleted at %s, before the grace ended at %s", del.Time.Format(time.StampMilli), min.Format(time.StampMilli))
	}
	want := events.DeleteCommand{ProxyID: ghost, Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(ghost),
		ProviderID: "pid-" + ghost, Attempt: 1, Reason: gcReason}
	if !equalJSON(del.Delete, want) {
		t.Errorf("delete command: got %+v, want %+v", del.Delete, want)
	}
	if del.Subject != events.CommandSubject("local", "t1", events.VerbDelete) {
		t.Errorf("delete subject: got %s", del.Subject)
	}

	// The orphan is still listed (this fake agent never deletes): the
	// rounds that follow repeat nothing.
	h.gcSettle(r, 5)
	h.settle(r, 2)
	dels := h.commandsOf(events.VerbDelete)
	if len(dels) != 1 {
		t.Errorf("delete commands: got %d (%+v), want only the orphan's", len(dels), dels)
	}
	var ret []bus.Event
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
		if e.ID == ghost {
			ret = append(ret, e)
		}
	}
	if len(ret) != 1 {
		t.Fatalf("retiring events of the orphan: got %d, want 1", len(ret))
	}
	var rd events.ProxyRetiringData
	if err := ret[0].DecodeData(&rd); err != nil || rd.Reason != gcReason {
		t.Errorf("orphan's retiring: got %+v (%v), want reason %q", rd, err, gcReason)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyFailed)); n != 0 {
		t.Errorf("failed events: got %d, want 0 (every up proxy is listed or on a silent target)", n)
	}
	if t2.asked() == 0 {
		t.Error("the silent target was never asked for its inventory")
	}
	var x Proxy
	h.ok(proxyGet, `{"id":"`+quiet+`"}`, &x)
	if x.State != events.ProxyReady {
		t.Errorf("proxy on the silent target: state %s, want ready", x.State)
	}

	// Once the agent reports the orphan deleted and it leaves the
	// inventory, nothing more happens.
	t1.mu.Lock()
	t1.list = t1.list[:len(t1.list)-3]
	t1.list = append(t1.list, foreign, unmarked)
	t1.mu.Unlock()
	h.observe(ghost, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	before := h.lastSeq(bus.EventsStream)
	h.gcSettle(r, 5)
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("events after the orphan was gone: last seq %d, want %d", got, before)
	}
}

// TestGCDeletesLingeringInstanceOfDeletedProxy: a proxy recorded deleted
// whose instance is still listed is collected like an orphan, with a new
// retiring event (so the agent, which drops deletes of finished proxies,
// acts) and the next delete attempt.
func TestGCDeletesLingeringInstanceOfDeletedProxy(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	t1 := h.fakeInventory("local", "t1", false)
	r := h.startPlannerWith(gcConfig("gc"), nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]
	t1.add(marked(id, "demo", "local"))
	h.bringUp(id, "t1", events.ProxyReady)
	h.ok(proxyRecycle, `{"id":"`+id+`","now":true}`, nil)
	h.observe(id, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	h.waitState(r, id, events.ProxyDeleted)
	ids, _ = h.requested(2)
	t1.add(marked(ids[1], "demo", "local"))

	h.waitFor("second delete", func() bool { return len(h.commandsOf(events.VerbDelete)) >= 2 })
	dels := h.commandsOf(events.VerbDelete)
	if got := dels[1].Delete; got.ProxyID != id || got.Attempt != 2 || got.Reason != gcReason {
		t.Errorf("collector's delete: got %+v, want %s attempt 2 reason %q", got, id, gcReason)
	}
	evs, err := h.store.Load(t.Context(), events.AggregateProxy, id)
	if err != nil {
		t.Fatal(err)
	}
	if last := evs[len(evs)-1]; last.Kind != events.ProxyRetiring {
		t.Errorf("last event of the deleted proxy: got %s, want retiring", last.Kind)
	}
	var x Proxy
	h.ok(proxyGet, `{"id":"`+id+`"}`, &x)
	if x.State != events.ProxyDeleted {
		t.Errorf("state after the collector's retiring: got %s, want still deleted", x.State)
	}
}

// TestGCFailsVanishedProxyAndReplacesIt: a ready proxy whose instance its
// answering target does not list fails with class vanished once the grace
// has passed, and is retired and replaced.
func TestGCFailsVanishedProxyAndReplacesIt(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.fakeInventory("local", "t1", false) // lists nothing
	r := h.startPlannerWith(gcConfig("gc"), nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]
	up := time.Now()
	h.bringUp(id, "t1", events.ProxyReady)

	var failed bus.Event
	h.waitFor("failed (vanished)", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
			failed = e
			return true
		}
		return false
	})
	var f events.ProxyFailedData
	if err := failed.DecodeData(&f); err != nil || failed.ID != id || f.Class != events.ClassVanished {
		t.Fatalf("failed: got %s %+v (%v), want %s class vanished", failed.ID, f, err, id)
	}
	if min := up.Add(testGCGrace); failed.Time.Before(min) {
		t.Errorf("failed at %s, before the grace ended at %s", failed.Time.Format(time.StampMilli), min.Format(time.StampMilli))
	}
	h.requested(2)
	h.waitFor("delete", func() bool { return len(h.commandsOf(events.VerbDelete)) == 1 })
	if d := h.commandsOf(events.VerbDelete)[0].Delete; d.ProxyID != id || d.Reason != "failed: "+events.ClassVanished {
		t.Errorf("delete: got %+v, want %s reason %q", d, id, "failed: vanished")
	}
}

// TestGCIgnoresForgedEventsOfAnOrphan: an abandoned or retiring appended to
// an orphan's aggregate by a writer not allowed to (an agent) neither spares
// the instance nor counts as a delete attempt; the collector's retiring is
// appended after it.
func TestGCIgnoresForgedEventsOfAnOrphan(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	t1 := h.fakeInventory("local", "t1", false)
	ghost := events.NewProxyID("demo")
	h.observe(ghost, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "forged"})
	h.observe(ghost, events.ProxyAbandoned, 1, events.ProxyAbandonedData{Reason: "forged"})
	forged := h.lastSeq(bus.EventsStream)
	t1.add(marked(ghost, "demo", "local"))
	r := h.startPlannerWith(gcConfig("gc"), nil)
	h.waitFor("leader", r.IsLeader)

	h.waitFor("delete", func() bool { return len(h.commandsOf(events.VerbDelete)) >= 1 })
	if d := h.commandsOf(events.VerbDelete)[0].Delete; d.ProxyID != ghost || d.Attempt != 1 || d.Reason != gcReason {
		t.Errorf("delete: got %+v, want %s attempt 1 reason %q", d, ghost, gcReason)
	}
	evs, err := h.store.Load(t.Context(), events.AggregateProxy, ghost)
	if err != nil {
		t.Fatal(err)
	}
	if last := evs[len(evs)-1]; len(evs) != 3 || last.Kind != events.ProxyRetiring || last.Source != events.SourcePlanner || last.Seq <= forged {
		t.Errorf("orphan's events: %d, last %s from %s at %d; want 3, the planner's retiring after %d", len(evs), last.Kind, last.Source, last.Seq, forged)
	}
}
