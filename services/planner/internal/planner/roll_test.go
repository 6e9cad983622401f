package planner

import (
	"fmt"
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

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
		if contains(originals, id) {
			continue
		}
		d := req[id]
		if !contains(originals, d.Replaces) {
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
	creates := map[string]events.CreateCommand{}
	for _, c := range h.commandsOf(events.VerbCreate) {
		creates[c.Create.ProxyID] = c.opened()
	}
	for _, id := range replaced {
		c, ok := creates[id]
		if !ok {
			h.t.Errorf("replacement %s: no create command", id)
			continue
		}
		if err := checkCmd(c); err != nil {
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
	evSeq := h.lastSeq(bus.EventsStream)
	h.settle(r, 5)
	if got := h.lastSeq(bus.EventsStream); got != evSeq {
		t.Errorf("FLEET_EVENTS after the roll: last seq %d, want %d", got, evSeq)
	}
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
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.ProxyID == last && string(c.opened().UserData) != "#cloud-config\n" {
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
