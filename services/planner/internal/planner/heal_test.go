package planner

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// skewedLeader starts a leader whose proxy-age clock (rotation and
// unhealthy durations) runs skew ahead of the wall clock.
func (h *harness) skewedLeader(id string, skew *atomic.Int64, cfg Config) *running {
	h.t.Helper()
	cfg.ID = id
	r := h.startPlannerWith(cfg, nil, func(p *Planner) {
		p.ageNow = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	})
	h.waitFor("leader "+id, r.IsLeader)
	return r
}

// readyPool applies a pool and drives its proxies to ready; it returns
// their ids.
func (h *harness) readyPool(r *running, d *driver, body string, name string, size int) []string {
	h.t.Helper()
	h.ok(poolApply, body, nil)
	h.waitFor(name+" ready", func() bool {
		d.step()
		return r.poolView(name).States[events.ProxyReady] == size
	})
	var ids []string
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		var rd events.ProxyRequestedData
		if e.DecodeData(&rd) == nil && rd.Pool == name {
			ids = append(ids, e.ID)
		}
	}
	return ids
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
			if e.DecodeData(&rd) == nil && rd.Replaces == "" && !contains(originals, e.ID) {
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
