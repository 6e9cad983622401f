package planner

import (
	"maps"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// regionAgents announces local targets eu1, us1 and ap1 labelled with
// their region.
func (h *harness) regionAgents() {
	h.t.Helper()
	for _, r := range []string{"eu", "us", "ap"} {
		h.agent(agent.Info{Entry: "local", Target: r + "1", Labels: map[string]string{"region": r}})
	}
}

// regions folds the log into the active proxies of pool per region (as
// their requested events recorded it), and the rebalance requests.
func (h *harness) regions(pool string) (per map[string]int, moves []events.ProxyRequestedData) {
	h.t.Helper()
	state := map[string]string{}
	region := map[string]string{}
	for _, e := range h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		if e.Kind == events.ProxyRequested {
			var d events.ProxyRequestedData
			if err := e.DecodeData(&d); err != nil {
				h.t.Fatal(err)
			}
			if d.Pool != pool {
				continue
			}
			region[e.ID] = d.Labels["region"]
			if strings.HasPrefix(d.ReplaceReason, decide.RebalancePrefix) {
				moves = append(moves, d)
			}
		}
		if _, ok := region[e.ID]; !ok {
			continue
		}
		if to, ok := events.Transition(state[e.ID], e.Kind); ok {
			state[e.ID] = to
		}
	}
	per = map[string]int{}
	for id, s := range state {
		if decide.IsActive(s) {
			per[region[id]]++
		}
	}
	return per, moves
}

// waitSpread drives d until pool holds want ready proxies per region and
// nothing else active.
func (h *harness) waitSpread(r *running, d *driver, pool string, want map[string]int) {
	h.t.Helper()
	size := 0
	for _, n := range want {
		size += n
	}
	var per map[string]int
	h.waitFor("the spread "+labelsText(want), func() bool {
		d.step()
		per, _ = h.regions(pool)
		v := r.poolView(pool)
		return maps.Equal(per, want) && v.Active == size && v.States[events.ProxyReady] == size
	})
}

func labelsText(m map[string]int) string {
	var b strings.Builder
	for _, k := range []string{"eu", "us", "ap"} {
		if n, ok := m[k]; ok {
			b.WriteString(k + "=" + string(rune('0'+n)) + " ")
		}
	}
	return strings.TrimSpace(b.String())
}

// TestWeightChangeRespreadsSurgeFirst applies a pool of 10 spread 80/20
// over eu and us, then re-applies it with 50/30/20 over eu, us and ap:
// the planner moves proxies one at a time, each new proxy first, until
// the pool is 5/3/2, never holding more than 11 active proxies (checked
// after every event of the log); every move says why, and once the
// spread is met nothing more happens.
func TestWeightChangeRespreadsSurgeFirst(t *testing.T) {
	h := newHarness(t)
	h.regionAgents()
	r := h.leader()
	d := &driver{h: h, done: map[string]bool{}}
	h.ok(poolApply, `{"name":"spread","provider":"local","size":10,"placement":{"spread":[{"label":"region","weights":{"eu":80,"us":20}}]}}`, nil)
	h.waitSpread(r, d, "spread", map[string]int{"eu": 8, "us": 2})

	h.ok(poolApply, `{"name":"spread","provider":"local","size":10,"placement":{"spread":[{"label":"region","weights":{"eu":50,"us":30,"ap":20}}]}}`, nil)
	h.waitSpread(r, d, "spread", map[string]int{"eu": 5, "us": 3, "ap": 2})
	h.checkSurgeActive("spread", 10)
	_, moves := h.regions("spread")
	if len(moves) != 3 {
		t.Errorf("rebalance requests: %d, want 3 (eu→ap twice, eu→us once): %+v", len(moves), moves)
	}
	for _, m := range moves {
		if m.Replaces == "" || !strings.HasPrefix(m.ReplaceReason, "rebalance: region=eu holds ") {
			t.Errorf("move to %s replaces %q for %q, want an eu proxy for a reason naming eu's count and share", m.Labels["region"], m.Replaces, m.ReplaceReason)
		}
	}
	h.waitCondition("spread", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 10*time.Second)
	h.waitFor("the moved proxies deleted", func() bool { d.step(); return r.poolView("spread").States[events.ProxyRetiring] == 0 })
	h.settle(r, 2)
	d.step()
	h.appendsNothing("the rounds after the spread is met", func() { h.settle(r, 5) })
}

// TestSpreadReturnsWhenATargetComesBack is the acceptance scenario at the
// planner's level: a pool of 10 over eu/us/ap weighted 50/30/20 is placed
// 5/3/2; the ap agent stops and its proxies are lost: their replacements
// go to eu and us, and Placed names ap's missing share and why; the agent
// comes back: the spread returns to 5/3/2, surge first, never more than 11
// active proxies.
func TestSpreadReturnsWhenATargetComesBack(t *testing.T) {
	h := newHarness(t)
	h.regionAgents()
	r := h.leader()
	d := &driver{h: h, done: map[string]bool{}}
	h.ok(poolApply, `{"name":"spread","provider":"local","size":10,"placement":{"spread":[{"label":"region","weights":{"eu":50,"us":30,"ap":20}}]}}`, nil)
	h.waitSpread(r, d, "spread", map[string]int{"eu": 5, "us": 3, "ap": 2})

	h.goneAgent("local", "ap1")
	_, req := h.requested(10)
	for id, rd := range req {
		if rd.Target == "ap1" {
			h.observe(id, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassVanished, Reason: "instance gone", Attempt: 1})
		}
	}
	var per map[string]int
	h.waitFor("the ap proxies replaced on eu and us", func() bool {
		d.step()
		per, _ = h.regions("spread")
		v := r.poolView("spread")
		return per["ap"] == 0 && per["eu"]+per["us"] == 10 && v.States[events.ProxyReady] == 10
	})
	if per["eu"] < 5 || per["us"] < 3 {
		t.Errorf("while ap is gone: %v, want eu and us at least at their shares 5 and 3", per)
	}
	c := h.waitCondition("spread", events.ConditionPlaced, events.ConditionFalse, events.ReasonSpreadUnmet, 10*time.Second)
	if want := "spread: region=ap has 0 of its share 2: no live target with region=ap"; c.Message != want {
		t.Errorf("Placed message %q, want %q", c.Message, want)
	}
	if _, moves := h.regions("spread"); len(moves) != 0 {
		t.Errorf("rebalance requests while ap is gone: %+v, want none (nowhere to move to)", moves)
	}

	h.agent(agent.Info{Entry: "local", Target: "ap1", Labels: map[string]string{"region": "ap"}})
	h.waitSpread(r, d, "spread", map[string]int{"eu": 5, "us": 3, "ap": 2})
	h.checkSurgeActive("spread", 10)
	if _, moves := h.regions("spread"); len(moves) != 2 {
		t.Errorf("rebalance requests: %+v, want 2 (to ap)", moves)
	} else {
		for _, m := range moves {
			if m.Target != "ap1" || m.Replaces == "" {
				t.Errorf("move to %s replacing %q, want one to ap1 replacing a member", m.Target, m.Replaces)
			}
		}
	}
	h.waitCondition("spread", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 10*time.Second)
}

// TestPoolOverTwoEntries places a pool over the targets of its provider
// and of a further entry named in placement.entries, spread across both.
func TestPoolOverTwoEntries(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "eu1", Labels: map[string]string{"region": "eu"}})
	h.agent(agent.Info{Entry: "cloud", Target: "us1", Labels: map[string]string{"region": "us", "tier": "gold"}})
	h.agent(agent.Info{Entry: "other", Target: "us2", Labels: map[string]string{"region": "us"}})
	h.leader()
	h.ok(poolApply, `{"name":"two","provider":"local","size":4,"placement":{"entries":["cloud"],"spread":[{"label":"region","weights":{"eu":1,"us":1}}]}}`, nil)
	ids, req := h.requested(4)
	per := map[string]int{}
	for _, rd := range req {
		per[rd.Entry+"/"+rd.Target]++
	}
	if want := map[string]int{"local/eu1": 2, "cloud/us1": 2}; !maps.Equal(per, want) {
		t.Errorf("proxies per target %v, want %v", per, want)
	}
	creates := map[string]int{}
	for _, c := range h.createsOf(ids...) {
		creates[c.Create.Entry]++
	}
	if creates["local"] != 2 || creates["cloud"] != 2 {
		t.Errorf("create commands per entry %v, want 2 to local and 2 to cloud", creates)
	}

	// A target and a label only the further entry has are accepted.
	h.ok(poolApply, `{"name":"gold","provider":"local","size":1,"targets":["us1"],"placement":{"entries":["cloud"],"require":{"tier":["gold"]}}}`, nil)
	ids, req = h.requested(5)
	if rd := req[ids[4]]; rd.Pool != "gold" || rd.Entry != "cloud" || rd.Target != "us1" {
		t.Errorf("pool gold's proxy: %s on %s/%s, want gold on cloud/us1", rd.Pool, rd.Entry, rd.Target)
	}
	rep := h.request(poolApply, `{"name":"bad","provider":"local","size":1,"targets":["us9"],"placement":{"entries":["cloud"]}}`, nil)
	if rep.Error == nil || !hasField(rep.Error, "targets[0]") || !strings.Contains(rep.Error.Fields[0].Reason, "not a target of entries local, cloud (known: eu1, us1)") {
		t.Errorf("a target of neither entry: %s %+v, want a refusal at targets[0] naming both entries' targets", rep.Code, rep.Error)
	}
}

// TestFallbackCycleIsRefused: pool b falls back to a; applying a with
// fallback [b] would close a → b → a: refused naming the field and the
// cycle, and nothing is appended or sent.
func TestFallbackCycleIsRefused(t *testing.T) {
	h := newHarness(t)
	h.leader()
	h.ok(poolApply, `{"name":"a","provider":"local","size":0}`, nil)
	h.ok(poolApply, `{"name":"c","provider":"local","size":0,"gateway":{"fallback":["a"]}}`, nil)
	h.ok(poolApply, `{"name":"b","provider":"local","size":0,"gateway":{"fallback":["c"]}}`, nil)
	h.changesNothing(t, func() {
		rep := h.request(poolApply, `{"name":"a","provider":"local","size":0,"gateway":{"fallback":["b"]}}`, nil)
		if rep.Error == nil || !hasField(rep.Error, "gateway.fallback[0]") {
			t.Fatalf("apply closing a cycle: %s %+v, want a refusal naming gateway.fallback[0]", rep.Code, rep.Error)
		}
		if msg := rep.Error.Fields[0].Reason; !strings.Contains(msg, "a → b → c → a") {
			t.Errorf("refusal %q does not name the cycle a → b → c → a", msg)
		}
	})
	var pv struct {
		Spec events.PoolSpec `json:"spec"`
	}
	h.ok(poolGet, `{"name":"a"}`, &pv)
	if pv.Spec.Gateway.FallbackPools() != nil {
		t.Errorf("pool a's recorded fallback %v, want none", pv.Spec.Gateway.FallbackPools())
	}
	// Without the cycle the same fallback is taken.
	h.ok(poolApply, `{"name":"b","provider":"local","size":0}`, nil)
	h.ok(poolApply, `{"name":"a","provider":"local","size":0,"gateway":{"fallback":["b"]}}`, nil)
}
