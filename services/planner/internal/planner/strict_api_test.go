package planner

import (
	"context"
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

var instanceDelete = events.APISubject("instance", "delete")

// secretsSeq is the last sequence of the stream behind fleet-secrets: any
// write or delete of a secret moves it.
func (h *harness) secretsSeq() uint64 {
	h.t.Helper()
	return h.lastSeq("KV_" + bus.BucketSecrets)
}

// TestStrictInputIsRefusedAndChangesNothing: requests that encoding/json
// would have accepted (a missing or null size, a key in the wrong case, a
// duplicate key, at any depth) are refused with a message that starts with
// the path of the offending field, on every endpoint, and append no event,
// send no command and write no secret. The pool they aim at keeps its
// size.
func TestStrictInputIsRefusedAndChangesNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	const demo = `"name":"demo","provider":"local","auth":{"username":"u","password":"p"}`
	h.ok(poolApply, `{`+demo+`,"size":2}`, nil)
	h.requested(2)
	// The creates are published after the decisions, asynchronously: wait
	// for them, so that every case below starts from a settled stream.
	h.waitFor("the pool's 2 create commands", func() bool { return len(h.commandsOf(events.VerbCreate)) == 2 })

	cases := []struct {
		name    string
		subject string
		body    string
		code    string
		message string // exact
	}{
		{"no size", poolApply, `{` + demo + `}`, "422", `size: is required (send 0 to empty the pool)`},
		{"null size", poolApply, `{` + demo + `,"size":null}`, "422", `size: is required (send 0 to empty the pool)`},
		{"no size and a bad name", poolApply, `{"name":"Demo","provider":"local"}`, "422",
			`size: is required (send 0 to empty the pool); name: must be ` + events.IdentifierRule + ` (got "Demo")`},
		{"upper-case key", poolApply, `{"NAME":"demo","provider":"local","size":2}`, "400",
			`NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"duplicate key", poolApply, `{` + demo + `,"size":2,"size":0}`, "400", `size: duplicate key`},
		{"nested duplicate", poolApply, `{"name":"demo","provider":"local","size":2,"auth":{"username":"u","password":"p","username":"v"}}`, "400",
			`auth.username: duplicate key`},
		{"nested wrong type", poolApply, `{"name":"demo","provider":"local","size":2,"auth":{"username":7,"password":"p"}}`, "400",
			`auth.username: must be a string, got number`},
		{"unknown nested key", poolApply, `{"name":"demo","provider":"local","size":2,"auth":{"username":"u","password":"p","realm":"x"}}`, "400",
			`auth.realm: unknown field`},
		{"wrong element type", poolApply, `{"name":"demo","provider":"local","size":2,"targets":["t1",{}]}`, "400",
			`targets[1]: must be a string, got object`},
		{"unhealthyAfter too short", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"5s"}`, "422",
			`unhealthyAfter: must be at least 10s (got "5s")`},
		{"unhealthyAfter negative", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"-1m"}`, "422",
			`unhealthyAfter: must not be negative (got "-1m0s")`},
		{"unhealthyAfter not a duration", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"soon"}`, "400",
			`unhealthyAfter: must be a duration string such as "72h": "soon"`},
		{"unhealthyAfter a number", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":30}`, "400",
			`unhealthyAfter: must be a duration string such as "72h"`},
		{"trailing data", poolApply, `{` + demo + `,"size":0} {}`, "400",
			`(body): malformed JSON at byte 84: invalid character '{' after top-level value`},
		{"empty", poolApply, ``, "400", `(body): is empty; send a JSON object`},
		{"egress range with host bits", poolApply, `{` + demo + `,"size":2,"egress":{"allowCIDRs":["10.1.0.0/16","10.2.0.1/16"]}}`, "422",
			`egress.allowCIDRs[1]: has host bits set; write 10.2.0.0/16 (got "10.2.0.1/16")`},
		{"egress range not a range", poolApply, `{` + demo + `,"size":2,"egress":{"allowCIDRs":["intranet"]}}`, "422",
			`egress.allowCIDRs[0]: must be an IP address or a CIDR such as 10.1.0.0/16 (got "intranet")`},
		{"egress port out of range", poolApply, `{` + demo + `,"size":2,"egress":{"allowPorts":[8080,0,70000]}}`, "422",
			`egress.allowPorts[1]: must be between 1 and 65535 (got "0"); egress.allowPorts[2]: must be between 1 and 65535 (got "70000")`},
		{"egress port a string", poolApply, `{` + demo + `,"size":2,"egress":{"allowPorts":["8080"]}}`, "400",
			`egress.allowPorts[0]: must be an integer, got string`},
		{"egress unknown key", poolApply, `{` + demo + `,"size":2,"egress":{"allow":["10.0.0.0/8"]}}`, "400",
			`egress.allow: unknown field`},

		{"pool.get upper-case", poolGet, `{"Name":"demo"}`, "400", `Name: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"pool.get duplicate", poolGet, `{"name":"demo","name":"demo"}`, "400", `name: duplicate key`},
		{"pool.get unknown", poolGet, `{"name":"nope"}`, "422", `name: unknown pool "nope"`},
		{"pool.list unknown key", poolList, `{"all":true}`, "400", `all: unknown field`},
		{"pool.delete upper-case", poolDelete, `{"NAME":"demo"}`, "400", `NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"pool.delete duplicate", poolDelete, `{"name":"demo","name":"other"}`, "400", `name: duplicate key`},
		{"pool.delete unknown", poolDelete, `{"name":"nope"}`, "422", `name: unknown pool "nope"`},
		{"proxy.get unknown", proxyGet, `{"id":"nope-aaaaaaaaaa"}`, "422", `id: unknown proxy "nope-aaaaaaaaaa"`},
		{"proxy.list upper-case", proxyList, `{"POOL":"demo"}`, "400", `POOL: unknown field; keys are case-sensitive: did you mean "pool"?`},
		{"proxy.list unknown pool", proxyList, `{"pool":"nope"}`, "422", `pool: unknown pool "nope"`},
		{"proxy.delete duplicate", proxyDelete, `{"id":"x","skipCleanup":false,"skipCleanup":true}`, "400", `skipCleanup: duplicate key`},
		{"proxy.delete wrong type", proxyDelete, `{"id":"x","skipCleanup":"yes"}`, "400", `skipCleanup: must be true or false, got string`},
		{"proxy.recycle upper-case", proxyRecycle, `{"ID":"x"}`, "400", `ID: unknown field; keys are case-sensitive: did you mean "id"?`},
		{"proxy.report-ban duplicate", proxyReportBan, `{"id":"x","reason":"a","reason":"b"}`, "400", `reason: duplicate key`},
		{"instance.delete upper-case", instanceDelete, `{"entry":"local","target":"t1","NAME":"px-a"}`, "400",
			`NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"instance.delete without name", instanceDelete, `{"entry":"local","target":"t1"}`, "422", `name: is required`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			evBefore, cmdBefore, secBefore := h.lastSeq(bus.EventsStream), h.lastSeq(bus.CommandsStream), h.secretsSeq()
			r := h.request(tc.subject, tc.body, nil)
			if r.Code != tc.code {
				t.Fatalf("code: got %q (%+v), want %q", r.Code, r.Error, tc.code)
			}
			if r.Error.Message != tc.message {
				t.Errorf("message:\n got %q\nwant %q", r.Error.Message, tc.message)
			}
			if len(r.Error.Fields) == 0 || !strings.HasPrefix(r.Error.Message, r.Error.Fields[0].Field+": "+r.Error.Fields[0].Reason) {
				t.Errorf("fields %+v: the first does not start the message %q", r.Error.Fields, r.Error.Message)
			}
			if got := h.lastSeq(bus.EventsStream); got != evBefore {
				t.Errorf("FLEET_EVENTS last seq: got %d, want %d (unchanged)", got, evBefore)
			}
			if got := h.lastSeq(bus.CommandsStream); got != cmdBefore {
				t.Errorf("FLEET_CMDS last seq: got %d, want %d (unchanged)", got, cmdBefore)
			}
			if got := h.secretsSeq(); got != secBefore {
				t.Errorf("fleet-secrets last seq: got %d, want %d (unchanged)", got, secBefore)
			}
		})
	}
	var pv api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &pv)
	if pv.Spec.Size != 2 || pv.Revision != 1 || pv.Deleted {
		t.Errorf("pool after the refused requests: size %d revision %d deleted %v, want size 2 revision 1", pv.Spec.Size, pv.Revision, pv.Deleted)
	}
	// An explicit 0 is a size: it empties the pool.
	h.ok(poolApply, `{`+demo+`,"size":0}`, &pv)
	if pv.Spec.Size != 0 || pv.Revision != 2 {
		t.Errorf("explicit size 0: got size %d revision %d, want 0 at revision 2", pv.Spec.Size, pv.Revision)
	}
	if _, err := h.secret.Get(context.Background(), "demo"); err != nil {
		t.Errorf("secrets of the applied pool: %v", err)
	}
}
