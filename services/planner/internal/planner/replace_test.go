package planner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/planner/internal/decide"
)

func TestFailedProxyIsRetiredAndReplaced(t *testing.T) {
	h := newHarness(t)
	r, ids, req := h.demoPool(2, "t1", "t2")
	victim := ids[0]
	quotaTarget := req[victim].Target
	h.observe(victim, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: quotaTarget, Instance: events.InstanceName(victim), Attempt: 1})
	h.observe(victim, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassQuota, Reason: "no room", Attempt: 1})

	ids, req = h.requested(3)
	h.waitFor("retiring", func() bool { return len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)) >= 1 })
	h.settle(r, 3)
	ret := h.eventsOf(events.AggregateProxy, events.ProxyRetiring)
	if len(ret) != 1 || ret[0].ID != victim {
		t.Fatalf("retiring: got %d events (first %v), want 1 for %s", len(ret), ret, victim)
	}
	var rd events.ProxyRetiringData
	if err := ret[0].DecodeData(&rd); err != nil || rd.Reason != "failed: quota" {
		t.Errorf("retiring reason: got %q (%v), want %q", rd.Reason, err, "failed: quota")
	}
	dels := h.commandsOf(events.VerbDelete)
	if len(dels) != 1 || dels[0].Delete.ProxyID != victim {
		t.Fatalf("delete commands: got %+v, want one for %s", dels, victim)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Fatalf("requested: got %d, want 3 (2 + 1 replacement)", n)
	}
	replacement := ids[2]
	if req[replacement].Target == quotaTarget {
		t.Errorf("replacement placed on %s, which just answered quota", quotaTarget)
	}
	h.createsOf(ids[:3]...)
	if n := len(h.commandsOf(events.VerbCreate)); n != 3 {
		t.Errorf("create commands: got %d, want 3", n)
	}
}

func TestOperatorDeleteAndRecycle(t *testing.T) {
	h := newHarness(t)
	r, ids, req := h.demoPool(2, "t1")
	h.bringUp(ids[0], req[ids[0]].Target, events.ProxyReady)

	// Skip cleanup: retiring then abandoned, and no delete command.
	var x Proxy
	h.ok(proxyDelete, `{"id":"`+ids[1]+`","skipCleanup":true}`, &x)
	if x.State != events.ProxyAbandoned {
		t.Fatalf("skip-cleanup delete: state %q, want abandoned", x.State)
	}
	// Recycle now: retired with a delete command; a replacement follows.
	h.ok(proxyRecycle, `{"id":"`+ids[0]+`","now":true}`, &x)
	if x.State != events.ProxyRetiring {
		t.Fatalf("recycle: state %q, want retiring", x.State)
	}
	h.requested(4)
	h.settle(r, 3)
	dels := h.commandsOf(events.VerbDelete)
	if len(dels) != 1 || dels[0].Delete.ProxyID != ids[0] || dels[0].Delete.ProviderID != "pid-"+ids[0] {
		t.Fatalf("delete commands: got %+v, want one for %s", dels, ids[0])
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyAbandoned)); n != 1 {
		t.Errorf("abandoned: got %d, want 1", n)
	}
	// Repeating either request changes nothing.
	h.appendsNothing("the repeated requests", func() {
		h.ok(proxyRecycle, `{"id":"`+ids[0]+`","now":true}`, nil)
		h.ok(proxyRecycle, `{"id":"`+ids[0]+`"}`, nil)
		h.ok(proxyDelete, `{"id":"`+ids[1]+`"}`, nil)
	})
}

// TestStuckDecisionsAreReissued shortens the timeouts: a create nobody
// acted on is issued again with the next attempt, a proxy stuck
// provisioning fails (timeout) and is replaced, and a delete nobody acted
// on is issued again.
func TestStuckDecisionsAreReissued(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	const short = 300 * time.Millisecond
	r := h.startPlannerWith(Config{ID: "stuck", CreateTimeout: short, ProvisionTimeout: short, RetireTimeout: short}, nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]

	h.waitFor("create attempt 2", func() bool {
		for _, c := range h.commandsOf(events.VerbCreate) {
			if c.Create.ProxyID == id && c.Create.Attempt == 2 &&
				c.Header.Get(jetstream.MsgIDHeader) == events.CommandID(id, events.VerbCreate, 2) {
				return true
			}
		}
		return false
	})
	h.folded(r)
	var x Proxy
	h.ok(proxyGet, `{"id":"`+id+`"}`, &x)
	if x.State != events.ProxyRequested || x.Attempt < 2 {
		t.Fatalf("after re-issue: got %+v, want requested with attempt 2 or more", x)
	}

	// The agent starts it, then nothing more happens.
	h.observe(id, events.ProxyProvisioning, uint64(x.Attempt), events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: x.Attempt})
	h.waitFor("timeout failure", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
			var f events.ProxyFailedData
			if e.ID == id && e.DecodeData(&f) == nil && f.Class == events.ClassTimeout {
				return true
			}
		}
		return false
	})
	// Replaced, and its delete re-issued while no agent answers.
	h.waitFor("replacement", func() bool { return len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)) >= 2 })
	h.waitFor("delete attempt 2", func() bool {
		for _, c := range h.commandsOf(events.VerbDelete) {
			if c.Delete.ProxyID == id && c.Delete.Attempt == 2 {
				return true
			}
		}
		return false
	})
}

// TestCreateForDeadTargetFails: a proxy requested on a target whose agent
// went away fails (timeout) instead of waiting forever, and is placed
// elsewhere.
func TestCreateForDeadTargetFails(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlannerWith(Config{ID: "dead", CreateTimeout: 300 * time.Millisecond}, nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	// proxy.get answers from the projection, which may not hold the
	// request the stream already shows.
	h.folded(r)
	// t1's agent goes away; t2's arrives.
	h.goneAgent("local", "t1")
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	h.waitFor("failed", func() bool {
		// The planner may not have folded the requested event the test
		// read from the stream yet: unknown proxy means "not yet".
		rep := h.request(proxyGet, `{"id":"`+ids[0]+`"}`, nil)
		if rep.Code != "" {
			return false
		}
		var x Proxy
		return json.Unmarshal(rep.Body, &x) == nil && x.State == events.ProxyRetiring && x.FailureClass == events.ClassTimeout
	})
	// Nothing answers on t2 either, so each replacement times out in turn
	// and is replaced again: every one after the first is on t2.
	var reqs []bus.Event
	h.waitFor("a replacement", func() bool {
		reqs = h.eventsOf(events.AggregateProxy, events.ProxyRequested)
		return len(reqs) >= 2
	})
	for _, e := range reqs[1:] {
		var d events.ProxyRequestedData
		if err := e.DecodeData(&d); err != nil {
			t.Fatal(err)
		}
		if e.ID == ids[0] || d.Target != "t2" {
			t.Errorf("replacement %s on %s, want a new proxy on t2", e.ID, d.Target)
		}
	}
}

// replacementOf returns the proxy requested to replace id, if any.
func (h *harness) replacementOf(id string) (string, events.ProxyRequestedData, bool) {
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		var rd events.ProxyRequestedData
		if e.DecodeData(&rd) == nil && rd.Replaces == id {
			return e.ID, rd, true
		}
	}
	return "", events.ProxyRequestedData{}, false
}

// manualDriver is a driver that leaves the proxies named in hold alone.
type manualDriver struct {
	*driver
	hold map[string]bool
}

func (m *manualDriver) step() {
	for _, e := range m.h.events() {
		if e.Aggregate == events.AggregateProxy && e.Kind == events.ProxyRequested && m.hold[e.ID] {
			m.done[e.ID+"/"+e.Kind] = true
		}
	}
	m.driver.step()
}

// TestUnhealthyProxyIsReplacedSurgeFirst: a proxy unhealthy longer than
// unhealthyAfter gets a replacement at once; it keeps its place until the
// replacement is ready, then retires with its last probe error; the pool
// never holds more than size+1 proxies nor fewer than size ready ones.
func TestUnhealthyProxyIsReplacedSurgeFirst(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	var skew atomic.Int64
	r := h.skewedLeader("heal", &skew, Config{})
	d := &driver{h: h, done: map[string]bool{}}
	ids := h.readyPool(r, d, `{"name":"heal","provider":"local","size":3,"unhealthyAfter":"10s"}`, "heal", 3)
	x := ids[1]
	const probeErr = "probe: dial tcp 127.0.0.1:4000: connection refused"
	h.observe(x, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: probeErr, Streak: 3})
	h.waitState(r, x, events.ProxyUnhealthy)

	// Before unhealthyAfter nothing happens.
	h.settle(r, 5)
	if _, _, ok := h.replacementOf(x); ok {
		t.Fatal("replacement requested before unhealthyAfter")
	}

	skew.Store(int64(11 * time.Second))
	var y string
	h.waitFor("a replacement", func() bool {
		var ok bool
		y, _, ok = h.replacementOf(x)
		return ok
	})
	_, rd, _ := h.replacementOf(x)
	if rd.ReplaceReason != "unhealthy: "+probeErr || rd.Pool != "heal" {
		t.Errorf("replacement data: got %+v, want pool heal, reason %q", rd, "unhealthy: "+probeErr)
	}
	// The sick proxy stays until the replacement is ready.
	h.settle(r, 5)
	if got := h.rolledReasons()[x]; got != "" {
		t.Fatalf("sick proxy retired before its replacement was ready: %q", got)
	}
	if v := r.poolView("heal"); v.Active != 4 {
		t.Errorf("active during the replacement: got %d, want size+1 = 4", v.Active)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 4 {
		t.Errorf("requested: got %d, want 4 (one replacement)", n)
	}

	h.waitFor("the sick proxy retired", func() bool {
		d.step()
		return h.rolledReasons()[x] != ""
	})
	if got := h.rolledReasons()[x]; got != "unhealthy: "+probeErr {
		t.Errorf("retiring reason: got %q, want %q", got, "unhealthy: "+probeErr)
	}
	h.waitFor("pool whole", func() bool {
		d.step()
		v := r.poolView("heal")
		return v.States[events.ProxyReady] == 3 && v.Active == 3 && v.States[events.ProxyRetiring] == 0
	})
	h.checkSurgeActive("heal", 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 4 {
		t.Errorf("requested: got %d, want 4", n)
	}
	if y == "" {
		t.Fatal("no replacement id")
	}
}

// TestRecoveredProxyIsKept: a proxy that recovers before unhealthyAfter is
// neither replaced nor retired, however long it then stays ready.
func TestRecoveredProxyIsKept(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	var skew atomic.Int64
	r := h.skewedLeader("keep", &skew, Config{})
	d := &driver{h: h, done: map[string]bool{}}
	ids := h.readyPool(r, d, `{"name":"keep","provider":"local","size":2,"unhealthyAfter":"1m"}`, "keep", 2)
	x := ids[0]
	h.observe(x, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "timeout", Streak: 3})
	h.waitState(r, x, events.ProxyUnhealthy)
	skew.Store(int64(50 * time.Second))
	h.settle(r, 5)
	h.observe(x, events.ProxyReady, 2, events.ProxyReadyData{Address: "127.0.0.1:4000"})
	h.waitState(r, x, events.ProxyReady)
	skew.Store(int64(10 * time.Minute))
	h.settle(r, 5)
	if _, _, ok := h.replacementOf(x); ok {
		t.Error("a recovered proxy got a replacement")
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Errorf("retiring: got %d, want 0", n)
	}
}

// TestSickProxyRetiredWhenNoReplacementBecomesReady: when the replacement
// never becomes ready, the sick proxy is retired after twice
// unhealthyAfter, and the replacement stays requested in its place.
func TestSickProxyRetiredWhenNoReplacementBecomesReady(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	var skew atomic.Int64
	r := h.skewedLeader("late", &skew, Config{})
	d := &driver{h: h, done: map[string]bool{}}
	ids := h.readyPool(r, d, `{"name":"late","provider":"local","size":1,"unhealthyAfter":"10s"}`, "late", 1)
	x := ids[0]
	h.observe(x, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "502 from echo", Streak: 3})
	h.waitState(r, x, events.ProxyUnhealthy)
	skew.Store(int64(11 * time.Second))
	h.waitFor("a replacement", func() bool { _, _, ok := h.replacementOf(x); return ok })
	h.settle(r, 3)
	if got := h.rolledReasons()[x]; got != "" {
		t.Fatalf("retired before twice unhealthyAfter: %q", got)
	}
	skew.Store(int64(21 * time.Second))
	h.waitFor("retired", func() bool { return h.rolledReasons()[x] != "" })
	if got := h.rolledReasons()[x]; got != "unhealthy: 502 from echo" {
		t.Errorf("reason: got %q", got)
	}
	h.settle(r, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 2 {
		t.Errorf("requested: got %d, want 2 (the original and one replacement)", n)
	}
}

// TestSickDecisionSurvivesLeaderChange: the replacement a leader requested
// for a sick proxy is known to the next leader from the log alone: it
// requests no second one and retires the sick proxy when the replacement
// is ready.
func TestSickDecisionSurvivesLeaderChange(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	var skew atomic.Int64
	skew.Store(int64(11 * time.Second))
	first := h.skewedLeader("first", &skew, Config{})
	md := &manualDriver{driver: &driver{h: h, done: map[string]bool{}}, hold: map[string]bool{}}
	h.ok(poolApply, `{"name":"lc","provider":"local","size":2,"unhealthyAfter":"10s"}`, nil)
	h.waitFor("ready", func() bool { md.step(); return first.poolView("lc").States[events.ProxyReady] == 2 })
	ids, _ := h.requested(2)
	x := ids[0]
	h.observe(x, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "reset by peer", Streak: 3})
	// The skew is already past unhealthyAfter: the replacement follows
	// at once. Hold it back from the driver.
	var y string
	h.waitFor("a replacement", func() bool {
		var ok bool
		y, _, ok = h.replacementOf(x)
		return ok
	})
	md.hold[y] = true
	first.stop()

	second := h.skewedLeader("second", &skew, Config{})
	h.settle(second, 5)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Fatalf("requested after the leader change: got %d, want 3 (no second replacement)", n)
	}
	if got := h.rolledReasons()[x]; got != "" {
		t.Fatalf("retired before the replacement was ready: %q", got)
	}
	h.bringUp(y, "t1", events.ProxyReady)
	h.waitFor("the sick proxy retired by the new leader", func() bool { return h.rolledReasons()[x] != "" })
	if got := h.rolledReasons()[x]; got != "unhealthy: reset by peer" {
		t.Errorf("reason: got %q", got)
	}
}

// TestRollAndRotationCompleteWithAnUnhealthyMember: a spec change and a
// maxAge rotation each replace every member although one of them is
// unhealthy (not yet sick) throughout; the unhealthy one goes first.
func TestRollAndRotationCompleteWithAnUnhealthyMember(t *testing.T) {
	for _, tc := range []struct {
		name, apply, change string
		skew                time.Duration
		prefix              string
	}{
		{"roll", `{"name":"p","provider":"local","size":3,"image":"img-a","unhealthyAfter":"1h"}`,
			`{"name":"p","provider":"local","size":3,"image":"img-b","unhealthyAfter":"1h"}`, 0, decide.RolledPrefix},
		{"rotation", `{"name":"p","provider":"local","size":3,"maxAge":"1m","unhealthyAfter":"1h"}`, "", 2 * time.Minute, decide.RotatedPrefix},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.agent(agent.Info{Entry: "local", Target: "t1", Images: []string{"img-a", "img-b"}})
			var skew atomic.Int64
			r := h.skewedLeader("roll", &skew, Config{})
			md := &manualDriver{driver: &driver{h: h, done: map[string]bool{}}, hold: map[string]bool{}}
			originals := h.readyPool(r, md.driver, tc.apply, "p", 3)
			sick := originals[2]
			h.observe(sick, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "slow", Streak: 3})
			h.waitState(r, sick, events.ProxyUnhealthy)
			if tc.change != "" {
				h.ok(poolApply, tc.change, nil)
			}
			skew.Store(int64(tc.skew))
			var first string
			h.waitFor("every original replaced", func() bool {
				md.step()
				reasons := h.rolledReasons()
				for _, id := range originals {
					if reasons[id] == "" {
						return false
					}
				}
				return true
			})
			// Replacements are young again on the wall clock.
			skew.Store(0)
			h.waitFor("pool whole", func() bool {
				md.step()
				v := r.poolView("p")
				return v.Active == 3 && v.States[events.ProxyReady] == 3
			})
			for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
				var rd events.ProxyRequestedData
				if e.DecodeData(&rd) == nil && rd.Replaces != "" && first == "" {
					first = rd.Replaces
				}
			}
			if first != sick {
				t.Errorf("first replaced: got %s, want the unhealthy %s", first, sick)
			}
			for id, why := range h.rolledReasons() {
				if !strings.HasPrefix(why, tc.prefix) {
					t.Errorf("%s retired with %q, want %q…", id, why, tc.prefix)
				}
			}
			h.checkSurgeActive("p", 3)
		})
	}
}

// TestRollDoesNotWaitForAnUnhealthyCurrentMember: the outdated members are
// rolled although a member that is already current stays unhealthy: each
// is retired once its own replacement is ready, not when the pool has size
// ready proxies besides it (which the unhealthy member would prevent).
func TestRollDoesNotWaitForAnUnhealthyCurrentMember(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Images: []string{"img-a", "img-b"}})
	var skew atomic.Int64
	r := h.skewedLeader("roll", &skew, Config{})
	md := &manualDriver{driver: &driver{h: h, done: map[string]bool{}}, hold: map[string]bool{}}
	originals := h.readyPool(r, md.driver, `{"name":"p","provider":"local","size":2,"image":"img-a","unhealthyAfter":"1h"}`, "p", 2)
	h.ok(poolApply, `{"name":"p","provider":"local","size":3,"image":"img-b","unhealthyAfter":"1h"}`, nil)
	var current string
	h.waitFor("the member the scale-up adds", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
			var rd events.ProxyRequestedData
			if e.DecodeData(&rd) == nil && rd.Replaces == "" && !slices.Contains(originals, e.ID) {
				current = e.ID
			}
		}
		return current != ""
	})
	h.bringUp(current, "t1", events.ProxyUnhealthy)
	md.hold[current] = true
	h.waitFor("the originals rolled", func() bool {
		md.step()
		reasons := h.rolledReasons()
		return reasons[originals[0]] != "" && reasons[originals[1]] != ""
	})
	if got := h.rolledReasons()[current]; got != "" {
		t.Errorf("the current unhealthy member was retired: %q", got)
	}
	h.checkSurgeActive("p", 3)
}

// TestStuckCreateFailsAndIsPlacedElsewhere: a create re-issued
// MaxCreateAttempts times on a live target without ever reaching
// provisioning fails with class stuck, and its replacement goes to
// another target.
func TestStuckCreateFailsAndIsPlacedElsewhere(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.startPlannerWith(Config{ID: "stuck", CreateTimeout: 300 * time.Millisecond, MaxCreateAttempts: 3}, nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"s","provider":"local","size":1}`, nil)
	ids, req := h.requested(1)
	x := ids[0]
	h.waitFor("failed", func() bool { return len(h.eventsOf(events.AggregateProxy, events.ProxyFailed)) == 1 })
	var f events.ProxyFailedData
	if err := h.eventsOf(events.AggregateProxy, events.ProxyFailed)[0].DecodeData(&f); err != nil {
		t.Fatal(err)
	}
	if f.Class != events.ClassStuck || f.Attempt != 3 {
		t.Errorf("failed: got %+v, want class stuck at attempt 3", f)
	}
	creates := 0
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.ProxyID == x {
			creates++
		}
	}
	if creates != 3 {
		t.Errorf("creates of the stuck proxy: got %d, want 3", creates)
	}
	var other events.ProxyRequestedData
	h.waitFor("another proxy", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
			if e.ID != x {
				return e.DecodeData(&other) == nil
			}
		}
		return false
	})
	if other.Target == req[x].Target {
		t.Errorf("the next proxy was placed on %s again, where the create got stuck", other.Target)
	}
}

// TestRecycleIsSurgeFirst: proxy.recycle requests the replacement at once
// and retires the proxy only when it is ready; {"now":true} retires at
// once; a repeated recycle changes nothing.
func TestRecycleIsSurgeFirst(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	md := &manualDriver{driver: &driver{h: h, done: map[string]bool{}}, hold: map[string]bool{}}
	ids := h.readyPool(r, md.driver, `{"name":"rc","provider":"local","size":2}`, "rc", 2)
	x := ids[0]
	var got Proxy
	h.ok(proxyRecycle, `{"id":"`+x+`"}`, &got)
	if got.State != events.ProxyReady || got.ReplacedBy == "" || got.ReplaceReason != "recycled by operator" {
		t.Fatalf("recycle reply: got %+v, want ready with a replacement", got)
	}
	y := got.ReplacedBy
	md.hold[y] = true
	h.settle(r, 5)
	if why := h.rolledReasons()[x]; why != "" {
		t.Fatalf("retired before the replacement was ready: %q", why)
	}
	before := h.lastSeq("FLEET_EVENTS")
	h.ok(proxyRecycle, `{"id":"`+x+`"}`, nil)
	if after := h.lastSeq("FLEET_EVENTS"); after != before {
		t.Errorf("repeated recycle appended: last seq %d, want %d", after, before)
	}
	h.bringUp(y, "t1", events.ProxyReady)
	h.waitFor("retired", func() bool { return h.rolledReasons()[x] != "" })
	if why := h.rolledReasons()[x]; why != "recycled by operator" {
		t.Errorf("reason: got %q", why)
	}

	// now: retired at once.
	h.ok(proxyRecycle, `{"id":"`+ids[1]+`","now":true}`, &got)
	if got.State != events.ProxyRetiring {
		t.Errorf("recycle now: state %q, want retiring", got.State)
	}
}

// TestReportBanRequestsItsReplacement: report-ban retires the proxy and
// requests its replacement within the request itself, in one batch (the
// replacement names the ban, which no fill would). Only the leader decides
// it: a replica that does not lead serves no deciding endpoint, so with no
// leader the request finds no responder and nothing is appended.
func TestReportBanRequestsItsReplacement(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	lead := h.leader()
	d := &driver{h: h, done: map[string]bool{}}
	ids := h.readyPool(lead, d, `{"name":"bn","provider":"local","size":2}`, "bn", 2)
	follower := h.startPlanner("follower", nil)
	var x Proxy
	h.ok(proxyReportBan, `{"id":"`+ids[0]+`","reason":"captcha wall"}`, &x)
	if x.State != events.ProxyRetiring || x.Reason != "banned: captcha wall" {
		t.Fatalf("ban reply: got %+v", x)
	}
	y, rd, ok := h.replacementOf(ids[0])
	if !ok || rd.ReplaceReason != "banned: captcha wall" {
		t.Fatalf("no replacement requested by the ban itself (got %s %+v)", y, rd)
	}
	if follower.IsLeader() {
		t.Fatal("the follower leads; the test proves nothing")
	}
	h.waitFor("three create commands", func() bool { return len(h.commandsOf(events.VerbCreate)) >= 3 })
	if n := len(h.commandsOf(events.VerbCreate)); n != 3 {
		t.Errorf("create commands: got %d, want 3 (two originals, one replacement): %v", n, createdProxies(h))
	}

	// No leader: the lease is held by someone else, and a replica that
	// never leads serves the API.
	lead.stop()
	follower.stop()
	kv, err := h.c.JS.KeyValue(t.Context(), "fleet-planner")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(t.Context(), leaderKey, []byte("elsewhere")); err != nil {
		t.Fatal(err)
	}
	other := h.startPlanner("other", nil)
	h.waitFor("the other replica serving", other.Ready)
	var got Proxy
	h.ok(proxyGet, `{"id":"`+ids[1]+`"}`, &got)
	before := h.streamSeq(bus.EventsStream)
	_, err = h.c.NC.Request(proxyReportBan, []byte(`{"id":"`+ids[1]+`","reason":"captcha wall"}`), 2*time.Second)
	if !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("report-ban with no leader: got %v, want no responders (only the leader decides)", err)
	}
	if after := h.streamSeq(bus.EventsStream); after != before {
		t.Errorf("report-ban with no leader appended %d events", after-before)
	}
}

// createdProxies lists the proxies create commands were sent for, each
// with the attempts sent.
func createdProxies(h *harness) map[string][]int {
	out := map[string][]int{}
	for _, c := range h.commandsOf(events.VerbCreate) {
		out[c.Create.ProxyID] = append(out[c.Create.ProxyID], c.Create.Attempt)
	}
	return out
}

// TestProxyNeverReadyIsReplaced: a proxy running past the ready timeout
// without one probe through it passing (health does not call it
// unhealthy: it may still be booting) fails with class timeout and is
// replaced; a proxy that got ready in time is kept, however long after.
func TestProxyNeverReadyIsReplaced(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	const readyTimeout = 500 * time.Millisecond
	r := h.startPlannerWith(Config{ID: "boot", ReadyTimeout: readyTimeout}, nil)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"boot","provider":"local","size":2}`, nil)
	ids, _ := h.requested(2)
	stuck, fine := ids[0], ids[1]
	for _, id := range ids {
		h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1})
		h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
	}
	h.observe(fine, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})

	var failed events.ProxyFailedData
	h.waitFor("the never-ready proxy to fail", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
			if e.ID == stuck && e.DecodeData(&failed) == nil {
				return true
			}
		}
		return false
	})
	if failed.Class != events.ClassTimeout || !strings.HasPrefix(failed.Reason, "not ready after 500ms running") {
		t.Fatalf("failed: got %+v, want class timeout, reason not ready after 500ms running", failed)
	}
	h.waitFor("its replacement", func() bool { return len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)) == 3 })
	h.settle(r, 5)
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyFailed) {
		if e.ID == fine {
			t.Fatalf("the proxy that got ready failed: %s", e.Data)
		}
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Fatalf("requested: got %d, want 2 and one replacement", n)
	}
}

// TestReportBanRetiresAndReplaces: a reported ban retires the proxy with
// the ban as its reason, sends its delete and gets it replaced; repeating
// the report changes nothing; bad reports change nothing at all.
func TestReportBanRetiresAndReplaces(t *testing.T) {
	h := newHarness(t)
	r, ids, _ := h.demoPool(1, "t1")
	id := ids[0]
	h.bringUp(id, "t1", events.ProxyReady)
	h.waitState(r, id, events.ProxyReady)
	// The create is published asynchronously: the cases start once it is stored.
	h.waitFor("the create command", func() bool { return len(h.commandsOf(events.VerbCreate)) == 1 })

	for _, tc := range []struct {
		name, body, code, field, text string
	}{
		{"unknown id", `{"id":"demo-zzzzzzzzzz","reason":"403"}`, "422", "id", "unknown proxy"},
		{"no id", `{"reason":"403"}`, "422", "id", "required"},
		{"unknown field", `{"id":"` + id + `","why":"403"}`, "400", "why", "unknown field"},
		{"reason too long", `{"id":"` + id + `","reason":"` + strings.Repeat("x", api.MaxBanReason+1) + `"}`, "422", "reason", "at most"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h.changesNothing(t, func() {
				res := h.request(proxyReportBan, tc.body, nil)
				if res.Code != tc.code {
					t.Fatalf("code: got %q (%+v), want %q", res.Code, res.Error, tc.code)
				}
				if !hasField(res.Error, tc.field) || !strings.Contains(res.Error.Message, tc.text) {
					t.Errorf("error: got %+v, want field %q and %q in the message", res.Error, tc.field, tc.text)
				}
			})
		})
	}

	var x Proxy
	h.ok(proxyReportBan, `{"id":"`+id+`","reason":"403 from shop.example"}`, &x)
	const want = "banned: 403 from shop.example"
	if x.State != events.ProxyRetiring || x.Reason != want {
		t.Fatalf("report-ban reply: got state %q reason %q, want retiring %q", x.State, x.Reason, want)
	}
	ids, req := h.requested(2)
	if req[ids[1]].Pool != "demo" {
		t.Errorf("replacement: got %+v", req[ids[1]])
	}
	h.waitFor("delete", func() bool { return len(h.commandsOf(events.VerbDelete)) == 1 })
	if d := h.commandsOf(events.VerbDelete)[0].Delete; d.ProxyID != id || d.Reason != want || d.ProviderID != "pid-"+id {
		t.Errorf("delete: got %+v, want %s with reason %q", d, id, want)
	}
	ret := h.eventsOf(events.AggregateProxy, events.ProxyRetiring)
	var rd events.ProxyRetiringData
	if len(ret) != 1 || ret[0].DecodeData(&rd) != nil || rd.Reason != want {
		t.Errorf("retiring: got %d events (%+v), want one with reason %q", len(ret), rd, want)
	}
	// Reporting again, or without a reason, changes nothing.
	h.settle(r, 2)
	h.appendsNothing("the repeated report", func() { h.ok(proxyReportBan, `{"id":"`+id+`"}`, nil) })
}

// TestRotationIsSurgeFirst: with the rotation clock moved past maxAge,
// every proxy of a pool with maxAge is replaced, one surge proxy at a time,
// and the pool never has fewer than size ready proxies once it had them; a
// pool without maxAge is never rotated.
func TestRotationIsSurgeFirst(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	var skew atomic.Int64
	r := h.skewedLeader("rot", &skew, Config{})
	h.ok(poolApply, `{"name":"rot","provider":"local","size":2,"maxAge":"1m"}`, nil)
	h.ok(poolApply, `{"name":"steady","provider":"local","size":1}`, nil)
	d := &driver{h: h, done: map[string]bool{}}
	originals, req := h.requested(3)
	h.waitFor("3 ready", func() bool {
		d.step()
		return r.poolView("rot").States[events.ProxyReady] == 2 && r.poolView("steady").States[events.ProxyReady] == 1
	})
	// Younger than maxAge: nothing rotates.
	h.settle(r, 5)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Fatalf("retiring before maxAge: got %d, want 0", n)
	}

	// Every proxy is now older than maxAge plus any jitter.
	skew.Store(int64(2 * time.Minute))
	rotated := map[string]string{}
	h.waitFor("the originals rotated", func() bool {
		d.step()
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
			var rd events.ProxyRetiringData
			_ = e.DecodeData(&rd)
			rotated[e.ID] = rd.Reason
		}
		n := 0
		for _, id := range originals {
			if req[id].Pool == "rot" && rotated[id] != "" {
				n++
			}
		}
		return n == 2
	})
	skew.Store(0)
	h.waitFor("rotation over", func() bool {
		d.step()
		v := r.poolView("rot")
		return v.Active == 2 && v.States[events.ProxyReady] == 2 && v.States[events.ProxyRetiring] == 0
	})

	for _, id := range originals {
		switch req[id].Pool {
		case "rot":
			if !strings.HasPrefix(rotated[id], "rotated: ") {
				t.Errorf("original %s: retiring reason %q, want a rotation", id, rotated[id])
			}
		case "steady":
			if why, ok := rotated[id]; ok {
				t.Errorf("proxy %s of the pool without maxAge retired: %q", id, why)
			}
		}
	}

	// Fold the log: the rotating pool never had more than size+1 active
	// proxies, nor fewer than size ready once it had size, and every proxy
	// it created during the rotation names the one it replaces.
	state := map[string]string{}
	pool := map[string]string{}
	readyOnce := false
	for _, e := range h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		if e.Kind == events.ProxyRequested {
			var rd events.ProxyRequestedData
			_ = e.DecodeData(&rd)
			pool[e.ID] = rd.Pool
			if rd.Pool == "rot" && !slices.Contains(originals, e.ID) && rd.Replaces == "" {
				t.Errorf("replacement %s (seq %d) names no proxy it replaces", e.ID, e.Seq)
			}
		}
		if pool[e.ID] != "rot" {
			continue
		}
		switch e.Kind {
		case events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
			// As the planner folds them: progress moves active proxies only.
			if decide.IsActive(state[e.ID]) {
				state[e.ID] = e.Kind
			}
		default:
			state[e.ID] = e.Kind
		}
		active, ready := 0, 0
		for _, s := range state {
			if decide.IsActive(s) {
				active++
			}
			if s == events.ProxyReady {
				ready++
			}
		}
		if active > 3 {
			t.Errorf("seq %d: %d active proxies, want at most size+1 = 3", e.Seq, active)
		}
		if ready >= 2 {
			readyOnce = true
		} else if readyOnce {
			t.Errorf("seq %d (%s %s): %d ready proxies, want at least size = 2", e.Seq, e.ID, e.Kind, ready)
		}
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyFailed)); n != 0 {
		t.Errorf("failed events: got %d, want 0", n)
	}
	if got := h.lastSeq(bus.CommandsStream); got == 0 {
		t.Error("no commands published")
	}
}

// rolledReasons returns the retiring reason of every retired proxy.
func (h *harness) rolledReasons() map[string]string {
	out := map[string]string{}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
		var rd events.ProxyRetiringData
		if err := e.DecodeData(&rd); err != nil {
			h.t.Fatal(err)
		}
		out[e.ID] = rd.Reason
	}
	return out
}

// checkSurge folds the log of pool and fails the test if it ever had more
// than size+1 active proxies, or fewer than size ready once it had size.
func (h *harness) checkSurge(pool string, size int) { h.foldSurge(pool, size, true) }

// checkSurgeActive is checkSurge without the ready floor, for pools in
// which a proxy is made unhealthy on purpose.
func (h *harness) checkSurgeActive(pool string, size int) { h.foldSurge(pool, size, false) }

func (h *harness) foldSurge(pool string, size int, readyFloor bool) {
	h.t.Helper()
	state := map[string]string{}
	of := map[string]string{}
	readyOnce := false
	for _, e := range h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		if e.Kind == events.ProxyRequested {
			var rd events.ProxyRequestedData
			_ = e.DecodeData(&rd)
			of[e.ID] = rd.Pool
		}
		if of[e.ID] != pool {
			continue
		}
		if to, ok := events.Transition(state[e.ID], e.Kind); ok {
			state[e.ID] = to
		}
		active, ready := 0, 0
		for _, s := range state {
			if decide.IsActive(s) {
				active++
			}
			if s == events.ProxyReady {
				ready++
			}
		}
		if active > size+1 {
			h.t.Errorf("seq %d: %d active proxies, want at most size+1 = %d", e.Seq, active, size+1)
		}
		if ready >= size {
			readyOnce = true
		} else if readyOnce && readyFloor {
			h.t.Errorf("seq %d (%s %s): %d ready proxies, want at least size = %d", e.Seq, e.ID, e.Kind, ready, size)
		}
	}
}

// checkReplacements verifies that the proxies of pool requested after the
// originals each replace a distinct original, carry revision rev and pass
// check, and that their create commands pass checkCmd.
func (h *harness) checkReplacements(originals []string, rev int, check func(events.ProxyRequestedData) error, checkCmd func(events.CreateCommand) error) {
	h.t.Helper()
	ids, req := h.requested(2 * len(originals))
	replaced := map[string]string{}
	for _, id := range ids {
		if slices.Contains(originals, id) {
			continue
		}
		d := req[id]
		if !slices.Contains(originals, d.Replaces) {
			h.t.Errorf("replacement %s replaces %q, want one of %v", id, d.Replaces, originals)
		} else if prev, dup := replaced[d.Replaces]; dup {
			h.t.Errorf("%s replaced twice: by %s and %s", d.Replaces, prev, id)
		}
		replaced[d.Replaces] = id
		if d.Revision != rev {
			h.t.Errorf("replacement %s: revision %d, want %d", id, d.Revision, rev)
		}
		if err := check(d); err != nil {
			h.t.Errorf("replacement %s requested: %v", id, err)
		}
	}
	creates := h.createsOf(slices.Collect(maps.Values(replaced))...)
	for _, id := range replaced {
		if err := checkCmd(creates[id].opened()); err != nil {
			h.t.Errorf("replacement %s create command: %v", id, err)
		}
	}
}

// waitRolled drives d until every original is retired and the pool holds
// size ready proxies with none outdated; it returns the retiring reasons.
func (h *harness) waitRolled(r *running, d *driver, pool string, originals []string, size int) map[string]string {
	h.t.Helper()
	var reasons map[string]string
	h.waitFor("the originals rolled", func() bool {
		d.step()
		reasons = h.rolledReasons()
		for _, id := range originals {
			if reasons[id] == "" {
				return false
			}
		}
		v := r.poolView(pool)
		return v.Active == size && v.States[events.ProxyReady] == size && v.Outdated == 0
	})
	return reasons
}

// TestImageChangeRollsSurgeFirst: a new image replaces every proxy of the
// pool, one surge proxy at a time, with the new image.
func TestImageChangeRollsSurgeFirst(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Images: []string{"img-a", "img-b"}})
	h.agent(agent.Info{Entry: "local", Target: "t2", Images: []string{"img-a", "img-b"}})
	r := h.leader()
	h.ok(poolApply, `{"name":"roll","provider":"local","size":2,"image":"img-a"}`, nil)
	d := &driver{h: h, done: map[string]bool{}}
	originals, _ := h.requested(2)
	h.waitFor("2 ready", func() bool { d.step(); return r.poolView("roll").States[events.ProxyReady] == 2 })

	var pv api.PoolView
	h.ok(poolApply, `{"name":"roll","provider":"local","size":2,"image":"img-b","port":3129}`, &pv)
	if pv.Revision != 2 || pv.ShapeRevision != 2 {
		t.Fatalf("apply reply: revision %d, shape revision %d, want 2 and 2", pv.Revision, pv.ShapeRevision)
	}
	reasons := h.waitRolled(r, d, "roll", originals, 2)
	for _, id := range originals {
		if want := "rolled: spec revision 2"; reasons[id] != want {
			t.Errorf("original %s: retiring reason %q, want %q", id, reasons[id], want)
		}
	}
	h.checkReplacements(originals, 2, func(d events.ProxyRequestedData) error {
		if d.Image != "img-b" || d.Port != 3129 {
			return fmt.Errorf("image %q port %d, want img-b 3129", d.Image, d.Port)
		}
		return nil
	}, func(c events.CreateCommand) error {
		if c.Image != "img-b" || c.Port != 3129 || c.Revision != 2 {
			return fmt.Errorf("image %q port %d revision %d, want img-b 3129 2", c.Image, c.Port, c.Revision)
		}
		return nil
	})
	h.checkSurge("roll", 2)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyFailed)); n != 0 {
		t.Errorf("failed events: got %d, want 0", n)
	}
	// Rolled: nothing more happens.
	h.appendsNothing("the rounds after the roll", func() { h.settle(r, 5) })
}

// TestNonShapingChangesRollNothing: size, targets and maxAge change the
// revision but no proxy is replaced.
func TestNonShapingChangesRollNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.leader()
	h.ok(poolApply, `{"name":"steady","provider":"local","size":2}`, nil)
	d := &driver{h: h, done: map[string]bool{}}
	h.requested(2)
	h.waitFor("2 ready", func() bool { d.step(); return r.poolView("steady").States[events.ProxyReady] == 2 })

	steps := []struct {
		name, spec string
		size       int
	}{
		{"size", `{"name":"steady","provider":"local","size":3}`, 3},
		{"maxAge", `{"name":"steady","provider":"local","size":3,"maxAge":"24h"}`, 3},
		{"targets", `{"name":"steady","provider":"local","size":3,"maxAge":"24h","targets":["t1","t2"]}`, 3},
	}
	for i, st := range steps {
		var pv api.PoolView
		h.ok(poolApply, st.spec, &pv)
		if want := i + 2; pv.Revision != want || pv.ShapeRevision != 1 {
			t.Fatalf("after %s: revision %d, shape revision %d, want %d and 1", st.name, pv.Revision, pv.ShapeRevision, want)
		}
		h.waitFor("ready after "+st.name, func() bool {
			d.step()
			v := r.poolView("steady")
			return v.Active == st.size && v.States[events.ProxyReady] == st.size
		})
		h.settle(r, 3)
		if got := h.rolledReasons(); len(got) != 0 {
			t.Fatalf("after a %s change: retired %v, want nothing", st.name, got)
		}
		if v := r.poolView("steady"); v.Outdated != 0 {
			t.Fatalf("after a %s change: %d outdated, want 0", st.name, v.Outdated)
		}
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		var rd events.ProxyRequestedData
		_ = e.DecodeData(&rd)
		if rd.Replaces != "" {
			t.Errorf("%s replaces %s, want no replacement", e.ID, rd.Replaces)
		}
	}
}

// TestSecretChangeRolls: the public spec stays, but a new password and
// then new user-data (a new secrets digest) roll the pool, and the
// replacements' commands carry the new secrets.
func TestSecretChangeRolls(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	h.ok(poolApply, `{"name":"sec","provider":"local","size":1,"auth":{"username":"crawler","password":"old-pass"}}`, nil)
	d := &driver{h: h, done: map[string]bool{}}
	first, _ := h.requested(1)
	h.waitFor("1 ready", func() bool { d.step(); return r.poolView("sec").States[events.ProxyReady] == 1 })

	h.ok(poolApply, `{"name":"sec","provider":"local","size":1,"auth":{"username":"crawler","password":"new-pass"}}`, nil)
	reasons := h.waitRolled(r, d, "sec", first, 1)
	if want := "rolled: spec revision 2"; reasons[first[0]] != want {
		t.Errorf("original: retiring reason %q, want %q", reasons[first[0]], want)
	}
	h.checkReplacements(first, 2, func(d events.ProxyRequestedData) error {
		if d.Username != "crawler" {
			return fmt.Errorf("username %q, want crawler", d.Username)
		}
		return nil
	}, func(c events.CreateCommand) error {
		if c.Auth == nil || c.Auth.Username != "crawler" || c.Auth.Password != "new-pass" {
			return fmt.Errorf("auth %+v, want crawler with the new password", c.Auth)
		}
		return nil
	})
	h.checkSurge("sec", 1)

	ids, _ := h.requested(2)
	second := ids[1:]
	h.ok(poolApply, `{"name":"sec","provider":"local","size":1,"auth":{"username":"crawler","password":"new-pass"},"userData":"#cloud-config\n"}`, nil)
	h.waitRolled(r, d, "sec", second, 1)
	ids, req := h.requested(3)
	last := ids[2]
	if req[last].Replaces != second[0] || req[last].Revision != 3 {
		t.Errorf("user-data replacement: replaces %q at revision %d, want %q at 3", req[last].Replaces, req[last].Revision, second[0])
	}
	for _, c := range h.createsOf(last) {
		if string(c.opened().UserData) != "#cloud-config\n" {
			t.Errorf("user-data replacement command: user-data %q, want the new one", c.opened().UserData)
		}
	}
	h.checkSurge("sec", 1)
	for _, e := range h.events() {
		if strings.Contains(string(e.Envelope.Data), "new-pass") || strings.Contains(string(e.Envelope.Data), "cloud-config") {
			t.Errorf("event %d carries a secret", e.Seq)
		}
	}
}

// TestRollSurvivesRestart: a planner stopped with the surge proxy of a roll
// requested is succeeded by one that finishes the roll without creating a
// second replacement for the same proxy.
func TestRollSurvivesRestart(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Images: []string{"img-a", "img-b"}})
	h.agent(agent.Info{Entry: "local", Target: "t2", Images: []string{"img-a", "img-b"}})
	first := h.leader()
	h.ok(poolApply, `{"name":"roll","provider":"local","size":2,"image":"img-a"}`, nil)
	d := &driver{h: h, done: map[string]bool{}}
	originals, _ := h.requested(2)
	h.waitFor("2 ready", func() bool { d.step(); return first.poolView("roll").States[events.ProxyReady] == 2 })

	h.ok(poolApply, `{"name":"roll","provider":"local","size":2,"image":"img-b"}`, nil)
	// The surge proxy is requested; nothing brings it up before the stop.
	h.requested(3)
	h.settle(first, 3)
	first.stop()
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Fatalf("requested before the restart: got %d, want 3", n)
	}

	second := h.startPlanner("p2", nil)
	h.waitFor("new leader", second.IsLeader)
	if v := second.poolView("roll"); v.Outdated != 2 || v.ShapeRevision != 2 {
		t.Fatalf("rebuilt pool: %d outdated at shape revision %d, want 2 at 2", v.Outdated, v.ShapeRevision)
	}
	h.settle(second, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Fatalf("requested after the restart, before progress: got %d, want 3", n)
	}
	h.waitRolled(second, d, "roll", originals, 2)
	h.checkReplacements(originals, 2, func(d events.ProxyRequestedData) error {
		if d.Image != "img-b" {
			return fmt.Errorf("image %q, want img-b", d.Image)
		}
		return nil
	}, func(c events.CreateCommand) error {
		if c.Image != "img-b" {
			return fmt.Errorf("image %q, want img-b", c.Image)
		}
		return nil
	})
	h.checkSurge("roll", 2)
}

// TestShapeOf: only the instance-shaping fields change the shape.
func TestShapeOf(t *testing.T) {
	base := events.PoolSpec{Name: "p", Provider: "local", Size: 2, Image: "a", Profile: "s", Port: 3128, Auth: &events.ProxyAuth{Username: "u"}}
	cases := []struct {
		name   string
		change func(*events.PoolSpec)
		digest string
		same   bool
	}{
		{"size", func(s *events.PoolSpec) { s.Size = 5 }, "", true},
		{"targets", func(s *events.PoolSpec) { s.Targets = []string{"t1"} }, "", true},
		{"maxAge", func(s *events.PoolSpec) { s.MaxAge = events.Duration(3600e9) }, "", true},
		{"provider", func(s *events.PoolSpec) { s.Provider = "other" }, "", false},
		{"image", func(s *events.PoolSpec) { s.Image = "b" }, "", false},
		{"profile", func(s *events.PoolSpec) { s.Profile = "m" }, "", false},
		{"port", func(s *events.PoolSpec) { s.Port = 8080 }, "", false},
		{"username", func(s *events.PoolSpec) { s.Auth = &events.ProxyAuth{Username: "v"} }, "", false},
		{"no auth", func(s *events.PoolSpec) { s.Auth = nil }, "", false},
		{"secrets", func(*events.PoolSpec) {}, "d2", false},
	}
	want := shapeOf(base, "")
	for _, tc := range cases {
		s := base
		tc.change(&s)
		if got := shapeOf(s, tc.digest) == want; got != tc.same {
			t.Errorf("%s change: same shape %v, want %v", tc.name, got, tc.same)
		}
	}
}

// TestStuckDeleteShowsAConditionAndAGauge: a retiring proxy whose delete
// keeps failing (re-issued StuckDeletes times, its agent recording the
// failure) turns its pool's Cleanup condition False with reason
// DeleteStuck, naming the proxy, its target, since when it retires and
// the agent's last failure; the gauge proxyfleet_planner_deletes_stuck
// counts it. Once the proxy is deleted the condition turns True and the
// gauge 0.
func TestStuckDeleteShowsAConditionAndAGauge(t *testing.T) {
	ctx := context.Background()
	tel, err := telemetry.Setup(ctx, telemetry.Config{Service: "planner-test", MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Close(context.Background()) })
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlannerMeasured(Config{ID: "stuck", RetireTimeout: 300 * time.Millisecond, StuckDeletes: 2}, nil, tel.Meter)
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	id := ids[0]
	h.scrapeUntil(tel.MetricsAddr, "the gauge at 0", func(m scraped) bool {
		return m.is(`proxyfleet_planner_deletes_stuck{pool="demo"}`, 0)
	})

	h.ok(poolApply, `{"name":"demo","provider":"local","size":0}`, nil)
	h.waitFor("its delete", func() bool { return len(h.commandsOf(events.VerbDelete)) >= 1 })
	// The agent fails the delete (its backend refuses), every time.
	h.observe(id, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "volume busy"})
	c := h.waitCondition("demo", events.ConditionCleanup, events.ConditionFalse, events.ReasonDeleteStuck, 15*time.Second)
	for _, want := range []string{id + " on local/t1", "retiring since ", "last failure: permanent: volume busy"} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("Cleanup message %q does not say %q", c.Message, want)
		}
	}
	reissued := false
	for _, cmd := range h.commandsOf(events.VerbDelete) {
		reissued = reissued || cmd.Delete.ProxyID == id && cmd.Delete.Attempt >= 3
	}
	if !reissued {
		t.Errorf("Cleanup turned False before the delete was re-issued StuckDeletes (2) times")
	}
	h.scrapeUntil(tel.MetricsAddr, "the gauge at 1", func(m scraped) bool {
		return m.is(`proxyfleet_planner_deletes_stuck{pool="demo"}`, 1)
	})

	h.observe(id, events.ProxyDeleted, 1, events.ProxyDeletedData{})
	h.waitCondition("demo", events.ConditionCleanup, events.ConditionTrue, events.ReasonCleanedUp, 15*time.Second)
	h.scrapeUntil(tel.MetricsAddr, "the gauge back at 0", func(m scraped) bool {
		return m.is(`proxyfleet_planner_deletes_stuck{pool="demo"}`, 0)
	})
}

// TestDistinctEgressReplacesTheNewer: in a pool with distinctEgress, two
// members that health found egressing from one address (their ready
// events) are one too many: the newer is replaced, the replacement's
// requested event saying why (shared-egress), and retired once the
// replacement is ready.
func TestDistinctEgressReplacesTheNewer(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	h.ok(poolApply, `{"name":"apart","provider":"local","size":2,"distinctEgress":true}`, nil)
	ids, _ := h.requested(2)
	for _, id := range ids {
		h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1})
		h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4000", Attempt: 1})
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000", EgressIP: "192.0.2.7"})
	}
	all, req := h.requested(3)
	repl := all[2]
	d := req[repl]
	if d.Replaces != ids[0] && d.Replaces != ids[1] || !strings.HasPrefix(d.ReplaceReason, decide.SharedEgressPrefix+": egress 192.0.2.7") {
		t.Fatalf("replacement: got replaces %q for %q, want one of %v for a shared egress", d.Replaces, d.ReplaceReason, ids)
	}
	kept := ids[0]
	if d.Replaces == ids[0] {
		kept = ids[1]
	}
	if !strings.Contains(d.ReplaceReason, kept) {
		t.Errorf("reason %q does not name the member kept (%s)", d.ReplaceReason, kept)
	}
	h.observe(repl, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(repl), Attempt: 1})
	h.observe(repl, events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:4001", Attempt: 1})
	h.observe(repl, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4001", EgressIP: "192.0.2.8"})
	h.waitFor("the shared one retired", func() bool {
		for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
			var r events.ProxyRetiringData
			if e.ID == d.Replaces && e.DecodeData(&r) == nil && strings.HasPrefix(r.Reason, decide.SharedEgressPrefix) {
				return true
			}
		}
		return false
	})
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
		if e.ID == kept {
			t.Fatalf("the older member %s was retired", kept)
		}
	}
}
