package planner

import (
	"context"
	"encoding/json"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

func TestBadInputIsRefusedAndChangesNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Labels: map[string]string{"region": "eu"}})
	h.agent(agent.Info{Entry: "other", Target: "o1"})
	h.leader()
	h.waitFor("agents seen", func() bool {
		r1 := h.request(poolApply, `{"name":"probe","provider":"other","targets":["o1"],"size":-1}`, nil)
		r2 := h.request(poolApply, `{"name":"probe","provider":"local","targets":["t1"],"size":-1}`, nil)
		return r1.Error != nil && !hasField(r1.Error, "targets[0]") && r2.Error != nil && !hasField(r2.Error, "targets[0]")
	})

	cases := []struct {
		name      string
		subject   string
		body      string
		wantCode  string
		wantField string // a field the error must name; "" for none
		wantText  string // a substring of the message
	}{
		{"malformed JSON", poolApply, `{"name":"bad","provider":"local",`, "400", "", "malformed JSON"},
		{"empty body", poolApply, ``, "400", "", "empty"},
		{"not an object", poolApply, `[1,2,3]`, "400", "", "JSON object"},
		{"null", poolApply, `null`, "400", "", "JSON object"},
		{"wrong type", poolApply, `{"name":"bad","provider":"local","size":"3","userData":"SECRET-UD"}`, "400", "size", "integer"},
		{"wrong nested type", poolApply, `{"name":"bad","provider":"local","size":1,"auth":{"username":7}}`, "400", "auth.username", "string"},
		{"unknown field", poolApply, `{"name":"bad","provider":"local","size":1,"colour":"red","userData":"SECRET-UD"}`, "400", "colour", "unknown field"},
		{"bad duration", poolApply, `{"name":"bad","provider":"local","size":1,"maxAge":"soon"}`, "400", "maxAge", "duration"},
		{"bad name", poolApply, `{"name":"Bad_Name","provider":"local","size":1,"userData":"SECRET-UD"}`, "422", "name", "lowercase"},
		{"negative size", poolApply, `{"name":"bad","provider":"local","size":-1,"userData":"SECRET-UD"}`, "422", "size", "zero or more"},
		{"too large", poolApply, `{"name":"bad","provider":"local","size":100001}`, "422", "size", "at most 100000"},
		{"every field at once", poolApply, `{"name":"-x","provider":"local","size":-2,"port":70000}`, "422", "port", "size"},
		{"malformed provider", poolApply, `{"name":"bad","provider":"GCE Nowhere","size":1,"userData":"SECRET-UD"}`, "422", "provider", "lowercase"},
		{"unknown target", poolApply, `{"name":"bad","provider":"local","targets":["t1","t9"],"size":1}`, "422", "targets[1]", "not a target"},
		{"bad target name", poolApply, `{"name":"bad","provider":"local","targets":["T 1"],"size":1}`, "422", "targets[0]", "lowercase"},
		{"auth without password", poolApply, `{"name":"bad","provider":"local","size":1,"auth":{"username":"u"}}`, "422", "auth.password", "required"},
		{"placement weight not positive", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"spread":[{"label":"region","weights":{"eu":80,"us":0}}]}}`, "422", "placement.spread[0].weights.us", "whole number"},
		{"placement weight not whole", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"spread":[{"label":"region","weights":{"eu":0.5}}]}}`, "400", "placement.spread[0].weights.eu", "integer"},
		{"placement spread twice", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"spread":[{"label":"region","weights":{"eu":1}},{"label":"region","weights":{"us":1}}]}}`, "422", "placement.spread[1].label", "earlier spread"},
		{"placement malformed label", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"require":{"country":["DE"]}}}`, "422", "placement.require.country[0]", "label value"},
		{"placement unknown label", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"require":{"region":["eu"]},"spread":[{"label":"regoin","weights":{"eu":1}}]}}`, "422", "placement.spread[0].label", "no live target of entry local carries this label (their labels: region)"},
		{"placement entry twice", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"entries":["cloud","cloud"]}}`, "422", "placement.entries[1]", "listed twice"},
		{"placement entry the provider", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"entries":["local"]}}`, "422", "placement.entries[0]", "provider already"},
		{"placement entry malformed", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"entries":["Cloud 1"]}}`, "422", "placement.entries[0]", "lowercase"},
		{"placement unknown key", poolApply, `{"name":"bad","provider":"local","size":1,"placement":{"spreads":[]}}`, "400", "placement.spreads", "unknown field"},
		{"get unknown pool", poolGet, `{"name":"nope"}`, "422", "name", "unknown pool"},
		{"get without name", poolGet, `{}`, "422", "name", "required"},
		{"delete unknown pool", poolDelete, `{"name":"nope"}`, "422", "name", "unknown pool"},
		{"delete malformed", poolDelete, `{"name":`, "400", "", "malformed"},
		{"list unknown pool", proxyList, `{"pool":"nope"}`, "422", "pool", "unknown pool"},
		{"get unknown proxy", proxyGet, `{"id":"nope-aaaaaaaaaa"}`, "422", "id", "unknown proxy"},
		{"delete proxy wrong type", proxyDelete, `{"id":"x","skipCleanup":"yes"}`, "400", "skipCleanup", "true or false"},
		{"delete unknown proxy", proxyDelete, `{"id":"nope-aaaaaaaaaa"}`, "422", "id", "unknown proxy"},
		{"recycle unknown field", proxyRecycle, `{"id":"x","later":true}`, "400", "later", "unknown field"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var r reply
			h.changesNothing(t, func() { r = h.request(tc.subject, tc.body, nil) })
			if r.Code != tc.wantCode {
				t.Fatalf("code: got %q (%+v), want %q", r.Code, r.Error, tc.wantCode)
			}
			wantBodyCode := map[string]string{"400": api.CodeBadRequest, "422": api.CodeInvalid}[tc.wantCode]
			if strings.Contains(tc.wantText, "unknown pool") || strings.Contains(tc.wantText, "unknown proxy") {
				wantBodyCode = api.CodeNotFound
			}
			if r.Error.Code != wantBodyCode {
				t.Errorf("body code: got %q, want %q", r.Error.Code, wantBodyCode)
			}
			if tc.wantField != "" && !hasField(r.Error, tc.wantField) {
				t.Errorf("fields: got %+v, want one naming %q", r.Error.Fields, tc.wantField)
			}
			if !strings.Contains(r.Error.Message, tc.wantText) {
				t.Errorf("message: got %q, want it to contain %q", r.Error.Message, tc.wantText)
			}
			keys, err := h.secret.Keys(context.Background())
			if err != nil && err != jetstream.ErrNoKeysFound {
				t.Fatal(err)
			}
			// The digest key is the planner's, made at its start.
			keys = slices.DeleteFunc(keys, func(k string) bool { return k == DigestKeyName })
			if len(keys) != 0 {
				t.Errorf("fleet-secrets keys: got %v, want no pool's", keys)
			}
		})
	}
	// The "every field at once" case names every problem.
	r := h.request(poolApply, `{"name":"-x","provider":"local","size":-2,"port":70000}`, nil)
	for _, f := range []string{"name", "size", "port"} {
		if !hasField(r.Error, f) {
			t.Errorf("every field: got %+v, want %q named", r.Error.Fields, f)
		}
	}
}

func TestApplyCreatesAndSpreadsProxies(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.leader()

	// The request of the README, exactly as written.
	var pv api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":3}`, &pv)
	if pv.Name != "demo" || pv.Revision != 1 || pv.Spec.Size != 3 || pv.Spec.Port != events.DefaultProxyPort {
		t.Fatalf("apply reply: got %+v, want demo revision 1 size 3 port %d", pv, events.DefaultProxyPort)
	}
	ids, req := h.requested(3)
	var creates []command
	h.waitFor("3 create commands", func() bool { creates = h.commandsOf(events.VerbCreate); return len(creates) >= 3 })
	h.settle(r, 3)
	if got := h.commandsOf(events.VerbCreate); len(got) != 3 {
		t.Fatalf("create commands: got %d, want 3", len(got))
	}
	perTarget := map[string]int{}
	for _, c := range creates {
		d, ok := req[c.Create.ProxyID]
		if !ok {
			t.Fatalf("create for %s, which was never requested", c.Create.ProxyID)
		}
		want := events.CreateCommand{
			ProxyID:   c.Create.ProxyID,
			ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: d.Target, Instance: events.InstanceName(c.Create.ProxyID), Revision: 1, Port: events.DefaultProxyPort},
			Attempt:   1,
		}
		if got := c.Create; !equalJSON(got, want) {
			t.Errorf("create command: got %+v, want %+v", got, want)
		}
		if c.Subject != events.CommandSubject("local", d.Target, events.VerbCreate) {
			t.Errorf("subject: got %s", c.Subject)
		}
		if c.Header.Get(jetstream.MsgIDHeader) != events.CommandID(c.Create.ProxyID, events.VerbCreate, 1) {
			t.Errorf("Nats-Msg-Id: got %q", c.Header.Get(jetstream.MsgIDHeader))
		}
		perTarget[d.Target]++
	}
	if perTarget["t1"]+perTarget["t2"] != 3 || perTarget["t1"] < 1 || perTarget["t2"] < 1 {
		t.Errorf("spread: got %v, want 3 proxies over both t1 and t2", perTarget)
	}

	// Re-applying the same spec appends nothing and answers the pool.
	h.appendsNothing("the re-apply", func() { h.ok(poolApply, `{"name":"demo","provider":"local","size":3,"port":3128}`, &pv) })
	if pv.Revision != 1 || pv.Active != 3 || pv.States[events.ProxyRequested] != 3 {
		t.Errorf("re-apply reply: got %+v, want revision 1 with 3 requested", pv)
	}

	// Reads.
	var pl api.PoolList
	h.ok(poolList, ``, &pl)
	if len(pl.Pools) != 1 || pl.Pools[0].Name != "demo" || pl.Pools[0].Active != 3 {
		t.Errorf("pool.list: got %+v", pl)
	}
	var xl api.ProxyList
	h.ok(proxyList, `{"pool":"demo"}`, &xl)
	if len(xl.Proxies) != 3 {
		t.Fatalf("proxy.list: got %d proxies, want 3", len(xl.Proxies))
	}
	var x Proxy
	h.ok(proxyGet, `{"id":"`+ids[0]+`"}`, &x)
	if x.ID != ids[0] || x.State != events.ProxyRequested || x.Pool != "demo" || x.Instance != events.InstanceName(ids[0]) {
		t.Errorf("proxy.get: got %+v", x)
	}
}

func TestScaleDownRetiresUnhealthyFirst(t *testing.T) {
	h := newHarness(t)
	r, ids, req := h.demoPool(3, "t1", "t2")
	// ids[0] is the oldest; make the newest one unhealthy.
	h.bringUp(ids[0], req[ids[0]].Target, events.ProxyReady)
	h.bringUp(ids[1], req[ids[1]].Target, events.ProxyReady)
	h.bringUp(ids[2], req[ids[2]].Target, events.ProxyUnhealthy)
	h.waitState(r, ids[2], events.ProxyUnhealthy)
	h.waitState(r, ids[1], events.ProxyReady)

	var pv api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, &pv)
	if pv.Revision != 2 {
		t.Fatalf("scale reply: revision %d, want 2", pv.Revision)
	}
	var retiring []bus.Event
	h.waitFor("2 retiring", func() bool {
		retiring = h.eventsOf(events.AggregateProxy, events.ProxyRetiring)
		return len(retiring) >= 2
	})
	h.settle(r, 3)
	retiring = h.eventsOf(events.AggregateProxy, events.ProxyRetiring)
	got := []string{retiring[0].ID, retiring[1].ID}
	sort.Strings(got)
	want := []string{ids[0], ids[2]} // the unhealthy one, then the oldest
	sort.Strings(want)
	if len(retiring) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("retired: got %v (%d events), want %v", got, len(retiring), want)
	}
	if retiring[0].ID != ids[2] {
		t.Errorf("first retired: got %s, want the unhealthy %s", retiring[0].ID, ids[2])
	}
	dels := h.commandsOf(events.VerbDelete)
	if len(dels) != 2 {
		t.Fatalf("delete commands: got %d, want 2", len(dels))
	}
	for _, d := range dels {
		if d.Delete.ProxyID != ids[0] && d.Delete.ProxyID != ids[2] {
			t.Errorf("delete for %s, want only %v", d.Delete.ProxyID, want)
		}
		if d.Delete.ProviderID != "pid-"+d.Delete.ProxyID || d.Delete.Attempt != 1 || d.Delete.Instance != events.InstanceName(d.Delete.ProxyID) {
			t.Errorf("delete command: got %+v", d.Delete)
		}
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Errorf("requested events: got %d, want 3 (no replacement on scale-down)", n)
	}
}

func TestPoolDeleteRetiresAll(t *testing.T) {
	h := newHarness(t)
	r, ids, req := h.demoPool(2, "t1")
	h.bringUp(ids[0], req[ids[0]].Target, events.ProxyReady)

	var pv api.PoolView
	h.ok(poolDelete, `{"name":"demo"}`, &pv)
	if !pv.Deleted || pv.Revision != 2 {
		t.Fatalf("delete reply: got %+v, want deleted at revision 2", pv)
	}
	h.waitFor("2 delete commands", func() bool { return len(h.commandsOf(events.VerbDelete)) >= 2 })
	h.settle(r, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 2 {
		t.Errorf("retiring: got %d, want 2", n)
	}
	if n := len(h.commandsOf(events.VerbDelete)); n != 2 {
		t.Errorf("delete commands: got %d, want 2", n)
	}
	// Deleting again changes nothing; the agents' deleted facts end it.
	h.appendsNothing("the second delete", func() { h.ok(poolDelete, `{"name":"demo"}`, nil) })
	for _, id := range ids {
		h.observe(id, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	}
	h.waitFor("pool gone from the list", func() bool {
		var pl api.PoolList
		h.ok(poolList, `{}`, &pl)
		return len(pl.Pools) == 0
	})
	// Re-applying a deleted pool brings it back with a new revision.
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, &pv)
	if pv.Deleted || pv.Revision != 3 {
		t.Errorf("re-apply after delete: got %+v, want revision 3, not deleted", pv)
	}
	h.requested(3)
}

// TestPoolEgressReachesCommands: a pool's egress allowance is shown by
// pool.get and carried by every create command; changing it is a new
// revision.
func TestPoolEgressReachesCommands(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	want := &events.Egress{AllowCIDRs: []string{"10.1.0.0/16", "fd12::/16"}, AllowPorts: []int{8080, 8443}}
	var pv api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2,"egress":{"allowCIDRs":["10.1.0.0/16","fd12::/16"],"allowPorts":[8080,8443]}}`, &pv)
	if !reflect.DeepEqual(pv.Spec.Egress, want) {
		t.Fatalf("apply reply egress: got %+v, want %+v", pv.Spec.Egress, want)
	}
	h.ok(poolGet, `{"name":"demo"}`, &pv)
	if !reflect.DeepEqual(pv.Spec.Egress, want) {
		t.Fatalf("pool.get egress: got %+v, want %+v", pv.Spec.Egress, want)
	}
	_, req := h.requested(2)
	for id, d := range req {
		if !reflect.DeepEqual(d.Egress, want) {
			t.Errorf("requested %s egress: got %+v, want %+v", id, d.Egress, want)
		}
	}
	var creates []command
	h.waitFor("2 create commands", func() bool { creates = h.commandsOf(events.VerbCreate); return len(creates) >= 2 })
	for _, c := range creates {
		if !reflect.DeepEqual(c.Create.Egress, want) {
			t.Errorf("create %s egress: got %+v, want %+v", c.Create.ProxyID, c.Create.Egress, want)
		}
	}
	var changed api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2,"egress":{"allowPorts":[8080]}}`, &changed)
	if changed.Revision != 2 || changed.ShapeRevision != 2 || !reflect.DeepEqual(changed.Spec.Egress, &events.Egress{AllowPorts: []int{8080}}) {
		t.Errorf("changing egress: revision %d, shape revision %d, egress %+v; want 2, 2 (the pool rolls), ports [8080]", changed.Revision, changed.ShapeRevision, changed.Spec.Egress)
	}
	// An empty allowance is no allowance.
	var empty, none api.PoolView
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2,"egress":{}}`, &empty)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, &none)
	if empty.Revision != 3 || none.Revision != 3 || none.Spec.Egress != nil || empty.Spec.Egress != nil {
		t.Errorf("empty egress then none: revisions %d and %d, egress %+v; want one revision 3 without egress", empty.Revision, none.Revision, none.Spec.Egress)
	}
}

// TestValidateReadsFreshHeartbeats: an agent that announced itself an
// instant ago is a known provider even though the planner's watch of
// fleet-agents has not delivered its heartbeat (here: no watch runs at all).
func TestValidateReadsFreshHeartbeats(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := bustest.Start(t)
	p, err := New(c, Config{ID: "t"}, testLogger(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := c.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	p.agents.kv = kv
	spec := events.PoolSpec{Name: "fresh", Provider: "local", Size: 1, Targets: []string{"t2"}}
	spec.Normalize()
	if _, known := (backend{p}).Targets(ctx, spec.Provider, spec.Targets); known {
		t.Fatal("a provider with no heartbeat at all was accepted")
	}
	for _, target := range []string{"t1", "t2"} {
		now := time.Now().UTC()
		b, _ := json.Marshal(agent.Heartbeat{Info: agent.Info{Entry: "local", Target: target, Type: "local"}, StartedAt: now, At: now})
		if _, err := kv.Put(ctx, agent.HeartbeatKey("local", target), b); err != nil {
			t.Fatal(err)
		}
	}
	if targets, known := (backend{p}).Targets(ctx, spec.Provider, spec.Targets); !known || !targets["t2"] {
		t.Fatalf("fresh heartbeats were not read: known %v, targets %v", known, targets)
	}
}

// fakeGateway reports a pool's demand into fleet-demand as a gateway does,
// every second so its report stays fresh, until it stops.
type fakeGateway struct {
	h     *harness
	kv    jetstream.KeyValue
	key   string
	pool  string
	name  string
	conns atomic.Int64
	stop  func()
}

// newFakeGateway is a gateway reporting conns connections for pool that
// has reported nothing yet.
func (h *harness) newFakeGateway(pool, name string, conns int) *fakeGateway {
	h.t.Helper()
	kv, err := h.c.JS.KeyValue(context.Background(), bus.BucketDemand)
	if err != nil {
		h.t.Fatal(err)
	}
	g := &fakeGateway{h: h, kv: kv, key: events.DemandKey(pool, name), pool: pool, name: name}
	g.conns.Store(int64(conns))
	return g
}

func (h *harness) gateway(pool, name string, conns int) *fakeGateway {
	h.t.Helper()
	g := h.newFakeGateway(pool, name, conns)
	g.put(time.Now())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(time.Second)
		defer tk.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
				g.put(time.Now())
			}
		}
	}()
	var once sync.Once
	g.stop = func() { once.Do(func() { cancel(); <-done }) }
	h.t.Cleanup(g.stop)
	return g
}

// staleReport writes one report of conns connections for pool, taken at
// at, that nobody renews: a gateway gone long ago. It is never fresh, not
// even for an instant an autoscaling round could see.
func (h *harness) staleReport(pool, name string, conns int, at time.Time) {
	h.t.Helper()
	h.newFakeGateway(pool, name, conns).put(at)
}

func (g *fakeGateway) put(at time.Time) {
	d := events.GatewayDemand{Pool: g.pool, Gateway: g.name, Connections: int(g.conns.Load()), At: at.UTC()}
	b, _ := json.Marshal(d)
	if _, err := g.kv.Put(context.Background(), g.key, b); err != nil {
		g.h.t.Errorf("put demand %s: %v", g.key, err)
	}
}

func (g *fakeGateway) set(conns int) {
	g.conns.Store(int64(conns))
	g.put(time.Now())
}

// leave stops the gateway and removes its report, as a gateway that shuts
// down does.
func (g *fakeGateway) leave() {
	g.h.t.Helper()
	g.stop()
	if err := g.kv.Delete(context.Background(), g.key); err != nil {
		g.h.t.Fatal(err)
	}
}

// scaledEvents returns the pool.scaled events of pool, in order.
func (h *harness) scaledEvents(pool string) []events.PoolScaledData {
	h.t.Helper()
	var out []events.PoolScaledData
	for _, e := range h.eventsOf(events.AggregatePool, events.PoolScaled) {
		if e.ID != pool {
			continue
		}
		var d events.PoolScaledData
		if err := e.DecodeData(&d); err != nil {
			h.t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

// activeProxies counts the pool's proxies that count toward its size in
// the log: requested and not retiring.
func (h *harness) activeProxies(pool string) int {
	h.t.Helper()
	live := map[string]bool{}
	for _, e := range h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		switch e.Kind {
		case events.ProxyRequested:
			var d events.ProxyRequestedData
			if err := e.DecodeData(&d); err == nil && d.Pool == pool {
				live[e.ID] = true
			}
		case events.ProxyRetiring, events.ProxyFailed:
			delete(live, e.ID)
		}
	}
	return len(live)
}

// scaleClock is an autoscaling clock that stands still until the test
// moves it: a stretch of low demand ends only when the test says so,
// however slow the machine.
type scaleClock struct{ at atomic.Int64 }

func newScaleClock() *scaleClock {
	c := &scaleClock{}
	c.at.Store(time.Now().UnixNano())
	return c
}

func (c *scaleClock) now() time.Time { return time.Unix(0, c.at.Load()) }

func (c *scaleClock) advance(d time.Duration) { c.at.Add(int64(d)) }

// startScaler starts a leader whose autoscaling clock is clock.
func (h *harness) startScaler(id string, clock *scaleClock) *running {
	h.t.Helper()
	r := h.startPlannerWith(Config{ID: id, AutoscaleInterval: 50 * time.Millisecond}, nil, func(p *Planner) {
		p.scaleNow = clock.now
	})
	h.waitFor("leader "+id, r.IsLeader)
	return r
}

// scaleRounds waits until r has completed n more autoscaling rounds.
func (h *harness) scaleRounds(r *running, n int64) {
	h.t.Helper()
	from := r.scaleRounds.Load()
	h.waitFor("autoscaling rounds", func() bool { return r.scaleRounds.Load() >= from+n })
}

// demandSeen waits until r's autoscaler sees conns connections for pool.
func (h *harness) demandSeen(r *running, pool string, conns int) {
	h.t.Helper()
	h.waitFor("demand seen", func() bool {
		n, ok := r.demand.of(pool, time.Now())
		return ok && n == conns
	})
}

const autoscaled = `{"name":"web","provider":"local","size":3,"autoscale":{"min":2,"max":10,"targetConnections":4,"scaleDownAfter":"10s"}}`

// TestAutoscaleFollowsDemand: demand of 37 connections (two gateways;
// a stale report and another pool's demand do not count) at 4 per proxy
// grows the pool from 3 to its max of 10 at once, with an event saying
// why; once demand drops the pool keeps its size until demand stayed low
// for scaleDownAfter, then shrinks to the most that stretch asked for, and
// with no demand at all back to min.
func TestAutoscaleFollowsDemand(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	clock := newScaleClock()
	r := h.startScaler("p1", clock)
	h.ok(poolApply, autoscaled, nil)
	h.requested(3)
	var pv api.PoolView
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 3 || pv.ScaleReason != "" {
		t.Fatalf("before any demand: size %d, reason %q; want the starting size 3 and no reason", pv.Size, pv.ScaleReason)
	}

	// Reports that do not count, then 7 connections (2 proxies, fewer
	// than 3: nothing happens while the clock stands still), then 30 more.
	h.gateway("other", "g1", 100)
	h.staleReport("web", "g3", 100, time.Now().Add(-time.Minute))
	g2 := h.gateway("web", "g2", 7)
	h.demandSeen(r, "web", 7)
	g1 := h.gateway("web", "g1", 30)
	h.waitFor("scaled to 10", func() bool { return len(h.scaledEvents("web")) >= 1 })
	want := events.PoolScaledData{Size: 10, Previous: 3, Reason: "autoscale: 37 connections for 10 proxies"}
	if got := h.scaledEvents("web"); len(got) != 1 || got[0] != want {
		t.Fatalf("scaled events: got %+v, want [%+v]", got, want)
	}
	h.waitFor("10 proxies", func() bool { return h.activeProxies("web") == 10 })
	h.folded(r)
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 10 || pv.ScaleReason != want.Reason {
		t.Errorf("pool.get after scaling up: size %d, reason %q; want 10, %q", pv.Size, pv.ScaleReason, want.Reason)
	}

	// Demand falls to 13 (4 proxies), then 6, then stops: nothing
	// shrinks while the clock stands still.
	g1.set(6)
	h.demandSeen(r, "web", 13)
	h.scaleRounds(r, 2)
	g2.leave()
	h.demandSeen(r, "web", 6)
	h.scaleRounds(r, 2)
	g1.leave()
	h.demandSeen(r, "web", 0)
	h.scaleRounds(r, 3)
	if n := len(h.scaledEvents("web")); n != 1 {
		t.Fatalf("scaled events before scaleDownAfter: got %d, want 1", n)
	}
	if n := h.activeProxies("web"); n != 10 {
		t.Fatalf("proxies before scaleDownAfter: got %d, want 10", n)
	}

	// scaleDownAfter of low demand: down to the most that stretch asked
	// for (13 connections, 4 proxies).
	clock.advance(10 * time.Second)
	h.waitFor("scaled to 4", func() bool { return len(h.scaledEvents("web")) >= 2 })
	want = events.PoolScaledData{Size: 4, Previous: 10, Reason: "autoscale: 13 connections for 4 proxies after 10s of low demand"}
	if got := h.scaledEvents("web"); len(got) != 2 || got[1] != want {
		t.Fatalf("scaled events: got %+v, want the second %+v", got, want)
	}
	h.waitFor("4 proxies", func() bool { return h.activeProxies("web") == 4 })

	// No demand for another scaleDownAfter: back to min.
	h.scaleRounds(r, 2)
	clock.advance(10 * time.Second)
	h.waitFor("scaled to 2", func() bool { return len(h.scaledEvents("web")) >= 3 })
	want = events.PoolScaledData{Size: 2, Previous: 4, Reason: "autoscale: 0 connections for 2 proxies after 10s of low demand"}
	if got := h.scaledEvents("web"); len(got) != 3 || got[2] != want {
		t.Fatalf("scaled events: got %+v, want the third %+v", got, want)
	}
	h.waitFor("2 proxies", func() bool { return h.activeProxies("web") == 2 })
	h.folded(r)
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 2 || pv.ScaleReason != want.Reason {
		t.Errorf("pool.get after scaling down: size %d, reason %q; want 2, %q", pv.Size, pv.ScaleReason, want.Reason)
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRetiring) {
		var d events.ProxyRetiringData
		if err := e.DecodeData(&d); err != nil || d.Reason != "scaled down" {
			t.Errorf("retiring %s: reason %q (%v), want \"scaled down\"", e.ID, d.Reason, err)
		}
	}
}

// TestAutoscaleIgnoresPoolsWithoutIt: a pool without autoscale keeps its
// size whatever the demand, and nothing is scaled.
func TestAutoscaleIgnoresPoolsWithoutIt(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startScaler("p1", newScaleClock())
	h.ok(poolApply, `{"name":"plain","provider":"local","size":2}`, nil)
	h.requested(2)
	h.gateway("plain", "g1", 400)
	h.demandSeen(r, "plain", 400)
	h.scaleRounds(r, 5)
	h.settle(r, 3)
	if got := h.scaledEvents("plain"); len(got) != 0 {
		t.Fatalf("scaled events of a pool without autoscale: got %+v, want none", got)
	}
	if n := h.activeProxies("plain"); n != 2 {
		t.Fatalf("proxies: got %d, want its size 2", n)
	}
}

// TestAutoscaleSurvivesReapplyAndRestart: re-applying an autoscaled pool
// keeps the size autoscaling reached (clamped into new bounds) and rolls
// nothing; a restarted planner starts from the size the log holds and
// appends no second decision for the same demand; turning autoscale off
// returns the pool to its size.
func TestAutoscaleSurvivesReapplyAndRestart(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	clock := newScaleClock()
	r := h.startScaler("p1", clock)
	h.ok(poolApply, autoscaled, nil)
	h.requested(3)
	h.gateway("web", "g1", 37)
	h.waitFor("scaled to 10", func() bool { return len(h.scaledEvents("web")) == 1 })
	h.waitFor("10 proxies", func() bool { return h.activeProxies("web") == 10 })

	// The same pool with another maxAge: still 10, nothing retired or
	// rolled.
	var pv api.PoolView
	h.ok(poolApply, `{"name":"web","provider":"local","size":3,"maxAge":"1h","autoscale":{"min":2,"max":10,"targetConnections":4,"scaleDownAfter":"10s"}}`, &pv)
	if pv.Size != 10 || pv.Revision != 2 {
		t.Fatalf("re-applied: size %d at revision %d, want 10 at 2", pv.Size, pv.Revision)
	}
	h.settle(r, 3)
	h.scaleRounds(r, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Fatalf("retiring after a re-apply: got %d, want 0", n)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 10 {
		t.Fatalf("requested after a re-apply: got %d, want 10 (no roll)", n)
	}

	// A lower max clamps the size at once: 8, and two retired.
	h.ok(poolApply, `{"name":"web","provider":"local","size":3,"maxAge":"1h","autoscale":{"min":2,"max":8,"targetConnections":4,"scaleDownAfter":"10s"}}`, &pv)
	if pv.Size != 8 || pv.Outdated != 0 {
		t.Fatalf("re-applied with max 8: size %d, outdated %d; want 8, 0", pv.Size, pv.Outdated)
	}
	h.waitFor("8 proxies", func() bool { return h.activeProxies("web") == 8 })
	if n := len(h.scaledEvents("web")); n != 1 {
		t.Fatalf("scaled events after the re-applies: got %d, want 1", n)
	}

	// A restarted planner (demand unchanged) starts from 8 and decides
	// nothing new.
	r.stop()
	clock.advance(time.Hour)
	r = h.startScaler("p2", clock)
	h.folded(r)
	h.demandSeen(r, "web", 37)
	h.scaleRounds(r, 5)
	h.settle(r, 3)
	if got := h.scaledEvents("web"); len(got) != 1 {
		t.Fatalf("scaled events after a restart: got %+v, want the one from before", got)
	}
	h.ok(poolGet, `{"name":"web"}`, &pv)
	if pv.Size != 8 {
		t.Fatalf("size after a restart: got %d, want 8", pv.Size)
	}
	if n := h.activeProxies("web"); n != 8 {
		t.Fatalf("proxies after a restart: got %d, want 8", n)
	}

	// Autoscale off: back to size 3.
	pv = api.PoolView{}
	h.ok(poolApply, `{"name":"web","provider":"local","size":3,"maxAge":"1h"}`, &pv)
	if pv.Size != 3 || pv.ScaleReason != "" {
		t.Fatalf("autoscale off: size %d, reason %q; want 3 and none", pv.Size, pv.ScaleReason)
	}
	h.waitFor("3 proxies", func() bool { return h.activeProxies("web") == 3 })
	h.scaleRounds(r, 3)
	if n := len(h.scaledEvents("web")); n != 1 {
		t.Fatalf("scaled events after autoscale was turned off: got %d, want 1", n)
	}
}

// TestPoolOfAnUnannouncedEntryWaitsForIt: a pool of an entry no agent has
// announced yet is accepted, as desired state is, with Placed False saying
// so; once an agent of the entry announces itself, the pool fills on it.
func TestPoolOfAnUnannouncedEntryWaitsForIt(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	var pv api.PoolView
	h.ok(poolApply, `{"name":"later","provider":"kvm-later","targets":["h1"],"size":2}`, &pv)
	if pv.Revision != 1 {
		t.Fatalf("apply: %+v, want revision 1", pv)
	}
	h.waitFor("Placed False naming the unannounced entry", func() bool {
		c, ok := events.FindCondition(r.poolView("later").Conditions, events.ConditionPlaced)
		return ok && c.Status == events.ConditionFalse && strings.Contains(c.Message, "no agent of this entry ever announced itself")
	})
	if n := len(h.commandsOf(events.VerbCreate)); n != 0 {
		t.Fatalf("creates before any agent of the entry: %d, want none", n)
	}
	h.agent(agent.Info{Entry: "kvm-later", Target: "h1"})
	ids, req := h.requested(2)
	for _, id := range ids {
		if req[id].Entry != "kvm-later" || req[id].Target != "h1" {
			t.Errorf("proxy %s placed on %s/%s, want kvm-later/h1", id, req[id].Entry, req[id].Target)
		}
	}
}
