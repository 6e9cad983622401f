package planner

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
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
	// hold, when set, runs once, on the next request, after its listing
	// was taken and before the answer is sent.
	hold func()
}

func (h *harness) fakeInventory(entry, target string, silent bool) *fakeInventory {
	h.t.Helper()
	f := &fakeInventory{silent: silent}
	sub, err := h.c.NC.Subscribe(events.AgentSubject(entry, target, events.AgentInventory), func(m *nats.Msg) {
		f.mu.Lock()
		f.requests++
		list := append([]agent.Instance{}, f.list...)
		hold := f.hold
		f.hold = nil
		f.mu.Unlock()
		if f.silent {
			return
		}
		if hold != nil {
			hold()
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
	h.appendsNothing("garbage collection after the orphan was gone", func() { h.gcSettle(r, 5) })
}

// TestGCJudgesNoListingOlderThanTheOrphansLastEvent: an agent deletes an
// orphan and reports it deleted while the collector's inventory request,
// answered before the delete, is on its way. That listing still holds the
// instance, but it predates the deleted event: the round decides nothing
// for it (no second retiring, no second delete), and the next round's
// listing, without it, ends the matter.
func TestGCJudgesNoListingOlderThanTheOrphansLastEvent(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	t1 := h.fakeInventory("local", "t1", false)
	cfg := gcConfig("gc")
	cfg.InventoryTimeout = waitTimeout // the held answer must not time out
	r := h.startPlannerWith(cfg, nil)
	h.waitFor("leader", r.IsLeader)

	ghost := events.NewProxyID("demo")
	t1.add(marked(ghost, "demo", "local"))
	var first command
	h.waitFor("delete of the orphan", func() bool {
		dels := h.commandsOf(events.VerbDelete)
		if len(dels) == 0 {
			return false
		}
		first = dels[0]
		return true
	})

	// The next round's answer is held until the grace has passed again
	// since that delete (a deleted orphan is judged again only then, and
	// rounds do not overlap), so the held round decides about the orphan.
	listed, release := make(chan struct{}), make(chan struct{})
	t1.mu.Lock()
	t1.hold = func() {
		close(listed)
		<-release
	}
	t1.mu.Unlock()
	select {
	case <-listed:
	case <-time.After(waitTimeout):
		t.Fatal("no inventory request after the hold was set")
	}
	h.waitFor("the orphan's grace to pass again", func() bool { return time.Since(first.Time) > testGCGrace })
	// The held answer lists the orphan; the agent deletes it now.
	t1.mu.Lock()
	t1.list = nil
	t1.mu.Unlock()
	h.observe(ghost, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	h.appendsNothing("garbage collection of a listing taken before the orphan's deleted event", func() {
		close(release)
		h.gcSettle(r, 3)
	})
	if dels := h.commandsOf(events.VerbDelete); len(dels) != 1 {
		var got []events.DeleteCommand
		for _, c := range dels {
			got = append(got, c.Delete)
		}
		t.Errorf("delete commands: got %d (%+v), want only the first", len(dels), got)
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

// TestFinishedProxiesLeaveMemory: over a long history the planner holds
// its live proxies and the last KeepFinished finished ones, no more;
// proxy.get answers about any older finished proxy from the log, as a
// planner that kept every proxy would (but for the note of its
// replacement, which another proxy's event records).
func TestFinishedProxiesLeaveMemory(t *testing.T) {
	h := newHarness(t)
	h.holdLease()
	g := newLogGen(t, h.c, 29)
	g.fill(20_000)
	const keep = 50
	r := h.startPlannerWith(Config{ID: "p1", KeepFinished: keep, SnapshotEvery: -1, SnapshotInterval: -1}, nil)
	h.folded(r)

	evs := streamEvents(t, h.c, 0)
	// A fold that keeps every proxy.
	all := newState(testLogger(), len(evs))
	applyEvents(all, evs, 0, evs[len(evs)-1].Seq)
	live, finished := 0, 0
	for _, x := range all.proxies {
		if events.IsTerminal(x.State) {
			finished++
		} else {
			live++
		}
	}
	if finished < 10*keep {
		t.Fatalf("the history finished %d proxies; want many more than %d", finished, keep)
	}
	r.mu.Lock()
	inMemory := len(r.st.proxies)
	r.mu.Unlock()
	if inMemory != live+keep {
		t.Errorf("proxies in memory: got %d, want %d live + %d finished", inMemory, live, keep)
	}

	checked := 0
	for id, want := range all.proxies {
		if !events.IsTerminal(want.State) {
			continue
		}
		r.mu.Lock()
		_, held := r.st.proxies[id]
		r.mu.Unlock()
		if held || checked >= 40 {
			continue
		}
		checked++
		var got events.ProxyView
		h.ok(proxyGet, `{"id":"`+id+`"}`, &got)
		w := want.ProxyView
		w.ReplacedBy, w.ReplaceReason = "", ""
		if !equalJSON(got, w) {
			gj, _ := json.Marshal(got)
			wj, _ := json.Marshal(w)
			t.Errorf("proxy.get %s from the log:\n got  %s\n want %s", id, gj, wj)
		}
	}
	if checked == 0 {
		t.Fatal("no finished proxy left memory")
	}
}

// TestGCAfterFinishedProxiesLeftMemory: with no finished proxy kept in
// memory, the collector still never touches the instance of an abandoned
// proxy, still collects the lingering instance of a deleted one, and
// proxy.get and instance.delete still tell what became of each.
func TestGCAfterFinishedProxiesLeftMemory(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	t1 := h.fakeInventory("local", "t1", false)
	cfg := gcConfig("gc")
	cfg.KeepFinished = -1
	rec := &orphanRecorder{}
	r := h.startPlannerWith(cfg, nil, func(p *Planner) { p.log = slog.New(rec) })
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	ids, _ := h.requested(2)
	gone, deleted := ids[0], ids[1]
	for _, id := range ids {
		t1.add(marked(id, "demo", "local"))
		h.bringUp(id, "t1", events.ProxyReady)
	}
	var x Proxy
	h.ok(proxyDelete, `{"id":"`+gone+`","skipCleanup":true}`, &x)
	if x.State != events.ProxyAbandoned {
		t.Fatalf("skip-cleanup delete: state %q, want abandoned", x.State)
	}
	h.ok(proxyRecycle, `{"id":"`+deleted+`","now":true}`, nil)
	h.observe(deleted, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	h.folded(r)
	r.mu.Lock()
	_, held1 := r.st.proxies[gone]
	_, held2 := r.st.proxies[deleted]
	r.mu.Unlock()
	if held1 || held2 {
		t.Fatalf("finished proxies in memory with KeepFinished -1: abandoned %v, deleted %v", held1, held2)
	}
	for id, want := range map[string]string{gone: events.ProxyAbandoned, deleted: events.ProxyDeleted} {
		h.ok(proxyGet, `{"id":"`+id+`"}`, &x)
		if x.State != want || x.ProviderID != "pid-"+id {
			t.Errorf("proxy.get %s: got state %s provider id %q, want %s (folded from the log)", id, x.State, x.ProviderID, want)
		}
	}

	// The deleted proxy's instance lingers: collected after the grace,
	// with the next delete attempt. The abandoned one's never.
	h.waitFor("the lingering instance collected", func() bool {
		for _, c := range h.commandsOf(events.VerbDelete) {
			if c.Delete.ProxyID == deleted && c.Delete.Reason == gcReason {
				return c.Delete.Attempt == 2
			}
		}
		return false
	})
	h.gcSettle(r, 5)
	for _, c := range h.commandsOf(events.VerbDelete) {
		if c.Delete.ProxyID == gone {
			t.Errorf("the abandoned proxy's instance was deleted: %+v", c.Delete)
		}
	}
	// Nor is it ever taken for an orphan (which would cost a read of its
	// events every grace period).
	if rec.saw(gone) {
		t.Errorf("the abandoned proxy's instance was taken for an orphan")
	}
	if !rec.saw(deleted) {
		t.Errorf("the deleted proxy's lingering instance was not reported as an orphan")
	}

	var rep api.InstanceDeleteReply
	b, _ := json.Marshal(api.InstanceDeleteRequest{Entry: "local", Target: "t1", Name: events.InstanceName(gone)})
	h.ok(instanceDelete, string(b), &rep)
	if rep.Previous != events.ProxyAbandoned || rep.ProxyID != gone {
		t.Errorf("instance.delete of the abandoned proxy's instance: got %+v, want previous abandoned", rep)
	}
}

// orphanRecorder records the proxies the garbage collector reports as
// owning an orphaned instance.
type orphanRecorder struct {
	mu      sync.Mutex
	proxies map[string]bool
}

func (o *orphanRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (o *orphanRecorder) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "marked instance without a live proxy; deleting it after the grace period" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "proxy" {
			o.mu.Lock()
			if o.proxies == nil {
				o.proxies = map[string]bool{}
			}
			o.proxies[a.Value.String()] = true
			o.mu.Unlock()
		}
		return true
	})
	return nil
}
func (o *orphanRecorder) WithAttrs([]slog.Attr) slog.Handler { return o }
func (o *orphanRecorder) WithGroup(string) slog.Handler      { return o }

func (o *orphanRecorder) saw(id string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.proxies[id]
}

func (f *fakeInventory) remove(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, inst := range f.list {
		if inst.Name == name {
			f.list = append(f.list[:i], f.list[i+1:]...)
			return
		}
	}
}

// TestInstanceDeleteOfAbandonedProxy: the instance of a proxy abandoned by
// proxy.delete with skipCleanup is deleted through instance.delete: one
// retiring event after abandoned (the proxy stays abandoned for the
// planner) and one delete command for exactly that instance. Instances
// that are not listed, unmarked, of another entry or of a live proxy, and
// targets without an agent, are refused with a 422 naming the field, and
// nothing changes.
func TestInstanceDeleteOfAbandonedProxy(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	t1 := h.fakeInventory("local", "t1", false)
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	ids, _ := h.requested(2)
	gone, live := ids[0], ids[1]
	for _, id := range ids {
		h.bringUp(id, "t1", events.ProxyReady)
		t1.add(marked(id, "demo", "local"))
	}
	foreign := events.NewProxyID("demo")
	t1.add(agent.Instance{Name: "px-handmade", ProviderID: "pid-handmade"}, marked(foreign, "demo", "other"))
	var x Proxy
	h.ok(proxyDelete, `{"id":"`+gone+`","skipCleanup":true}`, &x)
	if x.State != events.ProxyAbandoned {
		t.Fatalf("skip-cleanup delete: state %q, want abandoned", x.State)
	}
	h.requested(3) // the replacement
	h.settle(r, 2)

	body := func(target, name string) string {
		b, _ := json.Marshal(api.InstanceDeleteRequest{Entry: "local", Target: target, Name: name})
		return string(b)
	}
	refusals := []struct {
		name, body, message string
	}{
		{"not listed", body("t1", "px-aaaaaaaaaaaaaaaa"),
			`name: no marked instance of that name on local/t1 (its inventory lists only instances that carry the proxyfleet marker; unmarked instances are never touched) (got "px-aaaaaaaaaaaaaaaa")`},
		{"unmarked", body("t1", "px-handmade"),
			`name: the instance carries no proxy id in its marker; unmarked instances are never touched (got "px-handmade")`},
		{"another entry's", body("t1", events.InstanceName(foreign)),
			`name: the instance's marker names entry "other", not "local"; it is left alone (got "` + events.InstanceName(foreign) + `")`},
		{"live proxy", body("t1", events.InstanceName(live)),
			`name: the instance belongs to proxy ` + live + `, which is ready; delete the proxy with fleet.api.proxy.delete instead (got "` + events.InstanceName(live) + `")`},
		{"no agent", body("t9", events.InstanceName(gone)),
			`target: no agent serves local/t9; start its agent to list and delete its instances (got "t9")`},
		{"bad entry", `{"entry":"Local","target":"t1","name":"` + events.InstanceName(gone) + `"}`,
			`entry: must be ` + events.IdentifierRule + ` (got "Local")`},
	}
	for _, tc := range refusals {
		t.Run(tc.name, func(t *testing.T) {
			h.changesNothing(t, func() {
				rep := h.request(instanceDelete, tc.body, nil)
				if rep.Code != "422" || rep.Error.Code != api.CodeInvalid {
					t.Fatalf("got %q %+v, want 422 %s", rep.Code, rep.Error, api.CodeInvalid)
				}
				if rep.Error.Message != tc.message {
					t.Errorf("message:\n got %q\nwant %q", rep.Error.Message, tc.message)
				}
			})
		})
	}
	if n := len(h.commandsOf(events.VerbDelete)); n != 0 {
		t.Fatalf("delete commands before instance.delete: got %d, want 0", n)
	}

	var rep api.InstanceDeleteReply
	h.ok(instanceDelete, body("t1", events.InstanceName(gone)), &rep)
	want := api.InstanceDeleteReply{Entry: "local", Target: "t1", Name: events.InstanceName(gone), ProxyID: gone, Pool: "demo", Attempt: 2, Previous: events.ProxyAbandoned}
	if rep != want {
		t.Errorf("reply: got %+v, want %+v", rep, want)
	}
	evs, err := h.store.Load(t.Context(), events.AggregateProxy, gone)
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.Kind)
	}
	wantKinds := []string{events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady,
		events.ProxyRetiring, events.ProxyAbandoned, events.ProxyRetiring}
	if !slices.Equal(kinds, wantKinds) {
		t.Fatalf("events of the abandoned proxy: got %v, want %v", kinds, wantKinds)
	}
	var ret events.ProxyRetiringData
	if err := evs[len(evs)-1].DecodeData(&ret); err != nil || ret.Reason != instanceDeleteReason || ret.SkipCleanup {
		t.Errorf("retiring: got %+v (%v), want reason %q", ret, err, instanceDeleteReason)
	}
	dels := h.commandsOf(events.VerbDelete)
	wantCmd := events.DeleteCommand{ProxyID: gone, Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(gone),
		ProviderID: "pid-" + gone, Attempt: 2, Reason: instanceDeleteReason}
	if len(dels) != 1 || dels[0].Delete != wantCmd || dels[0].Subject != events.CommandSubject("local", "t1", events.VerbDelete) {
		t.Fatalf("delete commands: got %+v, want one %+v", dels, wantCmd)
	}
	h.ok(proxyGet, `{"id":"`+gone+`"}`, &x)
	if x.State != events.ProxyAbandoned {
		t.Errorf("planner state after instance.delete: got %s, want still abandoned", x.State)
	}

	// Repeating the request re-sends the same command: no new event, and
	// JetStream drops the duplicate.
	h.appendsNothing("the repeated request", func() { h.ok(instanceDelete, body("t1", events.InstanceName(gone)), &rep) })
	if rep != want {
		t.Errorf("repeated reply: got %+v, want %+v", rep, want)
	}
	if n := len(h.commandsOf(events.VerbDelete)); n != 1 {
		t.Errorf("delete commands after the repeat: got %d, want 1", n)
	}

	// The agent deletes it and says so; the planner's view does not move,
	// and the instance, gone from the inventory, cannot be deleted again.
	h.observe(gone, events.ProxyDeleted, 2, events.ProxyDeletedData{Attempt: 2})
	t1.remove(events.InstanceName(gone))
	h.settle(r, 2)
	h.ok(proxyGet, `{"id":"`+gone+`"}`, &x)
	if x.State != events.ProxyAbandoned {
		t.Errorf("planner state after the agent's deleted: got %s, want still abandoned", x.State)
	}
	if rr := h.request(instanceDelete, body("t1", events.InstanceName(gone)), nil); rr.Code != "422" {
		t.Errorf("instance.delete of a deleted instance: got %q, want 422", rr.Code)
	}
	var pv api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &pv)
	if pv.Active != 2 {
		t.Errorf("pool active: got %d, want 2 (the live proxy and the replacement)", pv.Active)
	}
}
