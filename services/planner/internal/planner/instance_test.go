package planner

import (
	"encoding/json"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

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
			evBefore, cmdBefore := h.lastSeq(bus.EventsStream), h.lastSeq(bus.CommandsStream)
			rep := h.request(instanceDelete, tc.body, nil)
			if rep.Code != "422" || rep.Error.Code != api.CodeInvalid {
				t.Fatalf("got %q %+v, want 422 %s", rep.Code, rep.Error, api.CodeInvalid)
			}
			if rep.Error.Message != tc.message {
				t.Errorf("message:\n got %q\nwant %q", rep.Error.Message, tc.message)
			}
			if got := h.lastSeq(bus.EventsStream); got != evBefore {
				t.Errorf("FLEET_EVENTS last seq: got %d, want %d (unchanged)", got, evBefore)
			}
			if got := h.lastSeq(bus.CommandsStream); got != cmdBefore {
				t.Errorf("FLEET_CMDS last seq: got %d, want %d (unchanged)", got, cmdBefore)
			}
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
	if !equalStrings(kinds, wantKinds) {
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
	before := h.lastSeq(bus.EventsStream)
	h.ok(instanceDelete, body("t1", events.InstanceName(gone)), &rep)
	if rep != want {
		t.Errorf("repeated reply: got %+v, want %+v", rep, want)
	}
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("repeated request appended: last seq %d, want %d", got, before)
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

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
