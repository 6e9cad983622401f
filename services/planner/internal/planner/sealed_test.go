package planner

import (
	"context"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

// agentWithoutKey announces a target whose agent has no curve key (one
// older than sealed commands).
func (h *harness) agentWithoutKey(info agent.Info) {
	h.t.Helper()
	if info.Type == "" {
		info.Type = "local"
	}
	h.mu.Lock()
	h.hbs[agent.HeartbeatKey(info.Entry, info.Target)] = info
	delete(h.keys, agent.HeartbeatKey(info.Entry, info.Target))
	err := h.putHeartbeat(context.Background(), info)
	h.mu.Unlock()
	if err != nil {
		h.t.Fatal(err)
	}
}

// TestCreateWaitsForTheAgentsKey: a pool with a password on a target
// whose agent announced no curve key sends no create (there is nothing to
// seal the password to), and pool.get says why; a pool without secrets is
// placed there as before. Once the agent announces a key, the creates go
// out sealed to it, with no plaintext secret in the stored command.
func TestCreateWaitsForTheAgentsKey(t *testing.T) {
	const password = "Wait-For-Key-Pw-93"
	h := newHarness(t)
	h.agentWithoutKey(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlannerWith(Config{ID: "keys", ReconcileInterval: 200 * time.Millisecond}, nil)
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"plain","provider":"local","size":1}`, nil)
	h.ok(poolApply, `{"name":"sec","provider":"local","size":2,"auth":{"username":"crawler","password":"`+password+`"}}`, nil)
	c := h.waitCondition("sec", events.ConditionPlaced, events.ConditionFalse, events.ReasonSecretsUnavailable, 5*time.Second)
	if !strings.Contains(c.Message, "local/t1") || !strings.Contains(c.Message, "curve key") {
		t.Errorf("condition message %q does not name the target and the missing key", c.Message)
	}
	h.waitFor("the plain pool's create", func() bool { return len(h.commandsOf(events.VerbCreate)) == 1 })
	h.settle(r, 3)
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.Pool != "plain" || c.Create.Sealed != nil {
			t.Fatalf("create %+v sent while the agent has no key; want only the plain pool's, unsealed", c.Create)
		}
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		var d events.ProxyRequestedData
		if err := e.DecodeData(&d); err == nil && d.Pool == "sec" {
			t.Fatalf("proxy %s of the secret pool decided with no key to seal to", e.ID)
		}
	}

	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.waitFor("the secret pool's creates", func() bool { return len(h.commandsOf(events.VerbCreate)) == 3 })
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.Pool != "sec" {
			continue
		}
		if c.Create.Sealed == nil || c.Secrets.Password != password || c.Create.Auth == nil || c.Create.Auth.Password != "" {
			t.Errorf("create %s: sealed %v, opened password ok %v, plaintext auth %+v", c.Create.ProxyID, c.Create.Sealed != nil, c.Secrets.Password == password, c.Create.Auth)
		}
		if strings.Contains(string(c.Raw), password) {
			t.Errorf("create %s carries the password in plaintext", c.Create.ProxyID)
		}
	}
	h.waitCondition("sec", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 5*time.Second)
}
