package planner

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

var (
	poolApply    = events.APISubject("pool", "apply")
	poolGet      = events.APISubject("pool", "get")
	poolList     = events.APISubject("pool", "list")
	poolDelete   = events.APISubject("pool", "delete")
	proxyGet     = events.APISubject("proxy", "get")
	proxyList    = events.APISubject("proxy", "list")
	proxyDelete  = events.APISubject("proxy", "delete")
	proxyRecycle = events.APISubject("proxy", "recycle")
)

func TestBadInputIsRefusedAndChangesNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "other", Target: "o1"})
	h.leader()
	h.waitFor("agents seen", func() bool {
		r := h.request(poolApply, `{"name":"probe","provider":"other","size":-1}`, nil)
		return r.Error != nil && !hasField(r.Error, "provider")
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
		{"unknown provider", poolApply, `{"name":"bad","provider":"gce-nowhere","size":1,"userData":"SECRET-UD"}`, "422", "provider", "known: local, other"},
		{"unknown target", poolApply, `{"name":"bad","provider":"local","targets":["t1","t9"],"size":1}`, "422", "targets[1]", "not a target"},
		{"bad target name", poolApply, `{"name":"bad","provider":"local","targets":["T 1"],"size":1}`, "422", "targets[0]", "lowercase"},
		{"auth without password", poolApply, `{"name":"bad","provider":"local","size":1,"auth":{"username":"u"}}`, "422", "auth.password", "required"},
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
			evBefore, cmdBefore := h.lastSeq(bus.EventsStream), h.lastSeq(bus.CommandsStream)
			r := h.request(tc.subject, tc.body, nil)
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
			if got := h.lastSeq(bus.EventsStream); got != evBefore {
				t.Errorf("FLEET_EVENTS last seq: got %d, want %d (unchanged)", got, evBefore)
			}
			if got := h.lastSeq(bus.CommandsStream); got != cmdBefore {
				t.Errorf("FLEET_CMDS last seq: got %d, want %d (unchanged)", got, cmdBefore)
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

func hasField(e *api.APIError, field string) bool {
	for _, f := range e.Fields {
		if f.Field == field {
			return true
		}
	}
	return false
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
	before := h.lastSeq(bus.EventsStream)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":3,"port":3128}`, &pv)
	if pv.Revision != 1 || pv.Active != 3 || pv.States[events.ProxyRequested] != 3 {
		t.Errorf("re-apply reply: got %+v, want revision 1 with 3 requested", pv)
	}
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("re-apply appended: last seq %d, want %d", got, before)
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

func equalJSON(a, b any) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// bringUp records the agent's and health service's facts for a proxy, up to
// state (running, ready or unhealthy).
func (h *harness) bringUp(id, target, state string) {
	h.t.Helper()
	h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: target, Instance: events.InstanceName(id), ProviderID: "pid-" + id, Attempt: 1})
	h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{ProviderID: "pid-" + id, Address: "127.0.0.1:4000", Attempt: 1})
	switch state {
	case events.ProxyReady:
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})
	case events.ProxyUnhealthy:
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})
		h.observe(id, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "probe failed", Streak: 3})
	}
}

func (h *harness) waitState(r *running, id, state string) {
	h.t.Helper()
	h.waitFor(id+" "+state, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		x := r.st.proxies[id]
		return x != nil && x.State == state
	})
}

func TestScaleDownRetiresUnhealthyFirst(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":3}`, nil)
	ids, req := h.requested(3)
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

func TestFailedProxyIsRetiredAndReplaced(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	ids, req := h.requested(2)
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
	if n := len(h.commandsOf(events.VerbCreate)); n != 3 {
		t.Errorf("create commands: got %d, want 3", n)
	}
}

func TestPoolDeleteRetiresAll(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	ids, req := h.requested(2)
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
	before := h.lastSeq(bus.EventsStream)
	h.ok(poolDelete, `{"name":"demo"}`, nil)
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("second delete appended: last seq %d, want %d", got, before)
	}
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

func TestOperatorDeleteAndRecycle(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	ids, req := h.requested(2)
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
	before := h.lastSeq(bus.EventsStream)
	h.ok(proxyRecycle, `{"id":"`+ids[0]+`","now":true}`, nil)
	h.ok(proxyRecycle, `{"id":"`+ids[0]+`"}`, nil)
	h.ok(proxyDelete, `{"id":"`+ids[1]+`"}`, nil)
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("repeated requests appended: last seq %d, want %d", got, before)
	}
}

func TestRestartEmitsNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	first := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":3}`, nil)
	ids, req := h.requested(3)
	h.bringUp(ids[0], req[ids[0]].Target, events.ProxyReady)
	h.waitState(first, ids[0], events.ProxyReady)
	// Scale to 1: two retiring (deletes outstanding), one ready.
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	h.waitFor("2 deletes", func() bool { return len(h.commandsOf(events.VerbDelete)) == 2 })
	h.settle(first, 3)
	var before api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &before)
	first.stop()

	evSeq, cmdSeq := h.lastEventSeq(), h.lastSeq(bus.CommandsStream)
	second := h.startPlanner("p2", nil)
	h.waitFor("new leader", second.IsLeader)
	h.settle(second, 5)
	if got := h.lastEventSeq(); got != evSeq {
		t.Errorf("FLEET_EVENTS last seq after restart: got %d, want %d", got, evSeq)
	}
	if got := h.lastSeq(bus.CommandsStream); got != cmdSeq {
		t.Errorf("FLEET_CMDS last seq after restart: got %d, want %d", got, cmdSeq)
	}
	var after api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &after)
	if !equalJSON(before, after) {
		t.Errorf("rebuilt pool: got %+v, want %+v", after, before)
	}
}

func TestTwoPlannersOneLeader(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	a := h.startPlanner("a", nil)
	b := h.startPlanner("b", nil)
	h.waitFor("a leader", func() bool { return a.IsLeader() || b.IsLeader() })
	if a.IsLeader() && b.IsLeader() {
		t.Fatal("both planners lead")
	}
	lead, other := a, b
	if b.IsLeader() {
		lead, other = b, a
	}
	h.ok(poolApply, `{"name":"demo","provider":"local","size":3}`, nil)
	h.requested(3)
	h.settle(lead, 3)
	if other.IsLeader() || other.rounds.Load() != 0 {
		t.Errorf("follower leads=%v after %d rounds; want it idle", other.IsLeader(), other.rounds.Load())
	}
	// Both replicas answer the API from their own projection.
	h.waitFor("follower projection", func() bool { return other.poolView("demo").Active == 3 })

	// The leader stops; the other takes over and decides nothing new.
	lead.stop()
	h.waitFor("takeover", other.IsLeader)
	h.settle(other, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Errorf("requested: got %d, want 3", n)
	}
	if n := len(h.commandsOf(events.VerbCreate)); n != 3 {
		t.Errorf("create commands: got %d, want 3", n)
	}
}

func TestSecretsNeverEnterEvents(t *testing.T) {
	const password, userData = "pa55-Sekr1t-xyz", "#cloud-config\nruncmd: [echo USERDATA-MARKER-42]\n"
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	spec := events.PoolSpec{Name: "sec", Provider: "local", Size: 2, Auth: &events.ProxyAuth{Username: "crawler", Password: password}, UserData: userData}
	body, _ := json.Marshal(spec)
	h.ok(poolApply, string(body), nil)
	ids, _ := h.requested(2)
	h.waitFor("create commands", func() bool { return len(h.commandsOf(events.VerbCreate)) == 2 })
	h.ok(proxyRecycle, `{"id":"`+ids[0]+`"}`, nil)
	h.requested(3)

	for _, e := range h.events() {
		raw, _ := json.Marshal(e.Envelope)
		hdr, _ := json.Marshal(e.Header)
		for _, s := range []string{password, "USERDATA-MARKER-42"} {
			if strings.Contains(string(raw), s) || strings.Contains(string(hdr), s) {
				t.Errorf("event %d (%s %s) contains a secret", e.Seq, e.ID, e.Kind)
			}
		}
	}
	applied := h.eventsOf(events.AggregatePool, events.PoolApplied)
	var ad events.PoolAppliedData
	if err := applied[0].DecodeData(&ad); err != nil {
		t.Fatal(err)
	}
	dk, err := h.secret.Get(context.Background(), DigestKeyName)
	if err != nil {
		t.Fatalf("digest key: %v", err)
	}
	if ad.SecretsDigest != spec.Secrets().Digest(dk.Value()) || ad.Spec.Auth == nil || ad.Spec.Auth.Username != "crawler" {
		t.Errorf("applied: got %+v, want the keyed digest and username only", ad)
	}
	e, err := h.secret.Get(context.Background(), "sec")
	if err != nil {
		t.Fatal(err)
	}
	var stored events.PoolSecrets
	_ = json.Unmarshal(e.Value(), &stored)
	if stored.Password != password || stored.UserData != userData || stored.Revision != 1 {
		t.Errorf("fleet-secrets: got revision %d, want the secrets of revision 1", stored.Revision)
	}
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.Auth == nil || c.Create.Auth.Username != "crawler" || c.Secrets.Password != password || string(c.Secrets.UserData) != userData {
			t.Errorf("create command for %s lacks the secrets the agent needs", c.Create.ProxyID)
		}
		if strings.Contains(string(c.Raw), password) || strings.Contains(string(c.Raw), "USERDATA-MARKER-42") ||
			strings.Contains(string(c.Raw), base64.StdEncoding.EncodeToString([]byte(userData))) {
			t.Errorf("create command for %s carries a secret in plaintext: %s", c.Create.ProxyID, c.Raw)
		}
	}
	// A changed password is a new revision, still out of the log.
	spec.Auth.Password = "another-Secret-77"
	body, _ = json.Marshal(spec)
	var pv api.PoolView
	h.ok(poolApply, string(body), &pv)
	if pv.Revision != 2 {
		t.Errorf("password change: revision %d, want 2", pv.Revision)
	}
	for _, e := range h.events() {
		if strings.Contains(string(e.Data), "another-Secret-77") {
			t.Errorf("event %d contains the new password", e.Seq)
		}
	}
}

func TestTraceFromRequestReachesCommands(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlanner("traced", tp.Tracer("planner-test"))
	h.waitFor("leader", r.IsLeader)

	ctx, span := tp.Tracer("operator").Start(context.Background(), "operator.apply")
	hdr := nats.Header{}
	telemetry.Inject(ctx, hdr)
	span.End()
	want := span.SpanContext().TraceID()
	if res := h.request(poolApply, `{"name":"demo","provider":"local","size":1}`, hdr); res.Code != "" {
		t.Fatalf("apply: %+v", res.Error)
	}
	var creates []command
	h.waitFor("create", func() bool { creates = h.commandsOf(events.VerbCreate); return len(creates) == 1 })
	got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), creates[0].Header)).TraceID()
	if got != want {
		t.Errorf("create command trace id: got %s, want %s", got, want)
	}
	applied := h.eventsOf(events.AggregatePool, events.PoolApplied)
	if got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), applied[0].Header)).TraceID(); got != want {
		t.Errorf("applied event trace id: got %s, want %s", got, want)
	}
	// The reconciler's decision continues it too, whatever batch carried
	// it.
	requested := h.eventsOf(events.AggregateProxy, events.ProxyRequested)
	if got := trace.SpanContextFromContext(telemetry.Extract(context.Background(), requested[0].Header)).TraceID(); got != want {
		t.Errorf("requested event trace id: got %s, want %s", got, want)
	}
}

// TestConflictIsRereadNotDoubleDecided drives the reconciler by hand on a
// stale snapshot: another decider retires the failed proxy first, so the
// planner's own retire conflicts and appends nothing, and the next round,
// on the re-read state, decides nothing more.
func TestConflictIsRereadNotDoubleDecided(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	first := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	h.settle(first, 2)
	first.stop()
	victim := ids[0]
	h.observe(victim, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "broken", Attempt: 1})

	p := h.manualPlanner()
	r := p.snapshot()
	// Another decider gets there first.
	last, err := h.store.Last(context.Background(), events.AggregateProxy, victim)
	if err != nil {
		t.Fatal(err)
	}
	other := events.ProxyRetiringData{Reason: "by someone else"}
	if _, err := h.store.Append(context.Background(), events.AggregateProxy, victim, events.ProxyRetiring, decisionID(victim, events.ProxyRetiring, last.Seq, other),
		other, &bus.Expect{Seq: last.Seq}); err != nil {
		t.Fatal(err)
	}
	f := p.flight(context.Background())
	p.reconcilePool(context.Background(), r, r.pools[0], f)
	f.wait()
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 1 {
		t.Fatalf("retiring events: got %d, want 1 (the planner's stale decision must conflict)", n)
	}
	if n := len(h.commandsOf(events.VerbDelete)); n != 0 {
		t.Fatalf("delete commands: got %d, want 0 from a refused decision", n)
	}
	// The replacement for the failed proxy is a decision of its own.
	h.requested(2)

	// Re-read, decide again: nothing left to do.
	h.feed(p.Planner)
	p.reconcile(context.Background())
	h.feed(p.Planner)
	p.reconcile(context.Background())
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 1 {
		t.Errorf("retiring after re-read: got %d, want 1", n)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 2 {
		t.Errorf("requested after re-read: got %d, want 2", n)
	}
}

// TestApplyConflictRereads makes the pool change between the planner's read
// and its append: the append conflicts, the planner re-reads the pool and
// applies on top of the newer revision.
func TestApplyConflictRereads(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	first := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	first.stop()

	p := h.manualPlanner()
	// A concurrent writer appends revision 2 the planner has not read.
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 2, Port: events.DefaultProxyPort}
	last, _ := h.store.Last(context.Background(), events.AggregatePool, "demo")
	rev2 := events.PoolAppliedData{Spec: spec, Revision: 2}
	if _, err := h.store.Append(context.Background(), events.AggregatePool, "demo", events.PoolApplied, decisionID("demo", events.PoolApplied, 2, rev2),
		rev2, &bus.Expect{Seq: last.Seq}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.store.Follow(ctx, p.st.seq+1, p.onEvent, nil)
	}()
	t.Cleanup(func() { cancel(); <-done })
	want := events.PoolSpec{Name: "demo", Provider: "local", Size: 5}
	want.Normalize()
	pv, aerr := backend{p.Planner}.ApplyPool(context.Background(), want)
	if aerr != nil {
		t.Fatalf("apply: %v", aerr)
	}
	if pv.Revision != 3 || pv.Spec.Size != 5 {
		t.Errorf("apply after conflict: got %+v, want revision 3 size 5", pv)
	}
	applied := h.eventsOf(events.AggregatePool, events.PoolApplied)
	if len(applied) != 3 {
		t.Errorf("applied events: got %d, want 3", len(applied))
	}
}

// manualPlanner builds a planner whose state is replayed but which runs no
// loops, and the reconciler of a term of its own: the test drives it.
func (h *harness) manualPlanner() *reconciler {
	h.t.Helper()
	p, err := New(h.c, Config{ID: "manual"}, testLogger(), nil, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	if err := p.openSecrets(context.Background()); err != nil {
		h.t.Fatal(err)
	}
	// It decides as the leader would: in a term of its own.
	term, err := p.store.ClaimTerm(context.Background(), "manual", 0)
	if err != nil {
		h.t.Fatal(err)
	}
	l := &leadership{term: term, cancel: func() {}, jobs: make(chan leaderJob), ended: make(chan struct{})}
	p.lease.leading.Store(l)
	h.feed(p)
	p.caughtUp.Store(true)
	agents, _ := h.agents.ListKeys(context.Background())
	for k := range agents.Keys() {
		e, err := h.agents.Get(context.Background(), k)
		if err == nil {
			p.onAgent(e)
		}
	}
	return newReconciler(p, l)
}

// feed applies every event p has not seen yet.
func (h *harness) feed(p *Planner) {
	h.t.Helper()
	for _, e := range h.events() {
		_ = p.onEvent(e)
	}
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

// TestLeaderRecoversUnsentCommands: a leader that crashed between
// appending a decision and publishing its command left a proxy requested
// and one retiring with no command. The next leader publishes both, with
// attempt 1, and decides nothing else.
func TestLeaderRecoversUnsentCommands(t *testing.T) {
	h := newHarness(t)
	first := h.leader()
	// The entry is known (seen since start) but has no live target.
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.waitFor("agent seen", func() bool {
		first.mu.Lock()
		defer first.mu.Unlock()
		return len(first.agents.last) == 1
	})
	h.goneAgent("local", "t1")
	h.waitFor("agent gone", func() bool {
		first.mu.Lock()
		defer first.mu.Unlock()
		return len(first.agents.last) == 0
	})
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	h.settle(first, 2)
	first.stop()
	// No agent was live, so nothing was requested. Now the "crashed
	// leader's" decisions:
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	ctx := context.Background()
	decide := func(id, kind string, n uint64, data any, expect uint64) uint64 {
		seq, err := h.store.Append(ctx, events.AggregateProxy, id, kind, events.ProxyEventID(id, kind, n), data, &bus.Expect{Seq: expect})
		if err != nil {
			t.Fatal(err)
		}
		return seq
	}
	x, y := events.NewProxyID("demo"), events.NewProxyID("demo")
	req := func(id string) events.ProxyRequestedData {
		return events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128}}
	}
	decide(x, events.ProxyRequested, 1, req(x), 0)
	seq := decide(y, events.ProxyRequested, 1, req(y), 0)
	decide(y, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "scaled down"}, seq)
	evSeq := h.lastEventSeq()

	second := h.startPlanner("p2", nil)
	h.waitFor("leader", second.IsLeader)
	h.waitFor("recovered commands", func() bool { return len(h.commands()) >= 2 })
	h.settle(second, 3)
	cmds := h.commands()
	if len(cmds) != 2 {
		t.Fatalf("commands: got %d, want 2", len(cmds))
	}
	for _, c := range cmds {
		switch c.Verb {
		case events.VerbCreate:
			if c.Create.ProxyID != x || c.Create.Attempt != 1 {
				t.Errorf("create: got %+v, want %s attempt 1", c.Create, x)
			}
		case events.VerbDelete:
			if c.Delete.ProxyID != y || c.Delete.Attempt != 1 {
				t.Errorf("delete: got %+v, want %s attempt 1", c.Delete, y)
			}
		}
	}
	if got := h.lastEventSeq(); got != evSeq {
		t.Errorf("events appended by the new leader: last seq %d, want %d", got, evSeq)
	}
}
