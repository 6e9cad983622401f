package planner

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

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
