package planner

import (
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

var proxyReportBan = events.APISubject("proxy", "report-ban")

// TestReportBanRetiresAndReplaces: a reported ban retires the proxy with
// the ban as its reason, sends its delete and gets it replaced; repeating
// the report changes nothing; bad reports change nothing at all.
func TestReportBanRetiresAndReplaces(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
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
			evBefore, cmdBefore := h.lastSeq(bus.EventsStream), h.lastSeq(bus.CommandsStream)
			res := h.request(proxyReportBan, tc.body, nil)
			if res.Code != tc.code {
				t.Fatalf("code: got %q (%+v), want %q", res.Code, res.Error, tc.code)
			}
			if !hasField(res.Error, tc.field) || !strings.Contains(res.Error.Message, tc.text) {
				t.Errorf("error: got %+v, want field %q and %q in the message", res.Error, tc.field, tc.text)
			}
			if got := h.lastSeq(bus.EventsStream); got != evBefore {
				t.Errorf("FLEET_EVENTS last seq: got %d, want %d (unchanged)", got, evBefore)
			}
			if got := h.lastSeq(bus.CommandsStream); got != cmdBefore {
				t.Errorf("FLEET_CMDS last seq: got %d, want %d (unchanged)", got, cmdBefore)
			}
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
	before := h.lastSeq(bus.EventsStream)
	h.ok(proxyReportBan, `{"id":"`+id+`"}`, nil)
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("repeated report appended: last seq %d, want %d", got, before)
	}
}
