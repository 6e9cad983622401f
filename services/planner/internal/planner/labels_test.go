package planner

import (
	"maps"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

// TestPlacedProxyCarriesItsTargetsLabels places one proxy on a labelled
// target and one on a target whose heartbeat holds labels breaking the
// rule: the first proxy's requested event, proxy.get and proxy.list show
// the target's labels; the second carries none (the planner ignores bad
// labels rather than record what the log's validation refuses).
func TestPlacedProxyCarriesItsTargetsLabels(t *testing.T) {
	h := newHarness(t)
	eu := map[string]string{"region": "eu-west", "country": "de", "provider": "hetzner"}
	h.agent(agent.Info{Entry: "local", Target: "a", Labels: eu})
	h.agent(agent.Info{Entry: "local", Target: "b", Labels: map[string]string{"region": "EU West"}})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	ids, req := h.requested(2)
	want := map[string]map[string]string{}
	for _, id := range ids {
		d := req[id]
		switch d.Target {
		case "a":
			want[id] = eu
		case "b":
			want[id] = nil
		default:
			t.Fatalf("proxy %s placed on %s, want a or b", id, d.Target)
		}
		if !maps.Equal(d.Labels, want[id]) {
			t.Errorf("requested event of %s on %s: labels %v, want %v", id, d.Target, d.Labels, want[id])
		}
	}
	if len(want) != 2 {
		t.Fatalf("proxies placed %v, want one on each target", req)
	}
	h.folded(r)
	for _, id := range ids {
		var x events.ProxyView
		h.ok(proxyGet, `{"id":"`+id+`"}`, &x)
		if !maps.Equal(x.Labels, want[id]) {
			t.Errorf("proxy.get %s on %s: labels %v, want %v", id, x.Target, x.Labels, want[id])
		}
	}
	var page struct {
		Proxies []events.ProxyView `json:"proxies"`
	}
	h.ok(proxyList, `{"pool":"demo"}`, &page)
	if len(page.Proxies) != 2 {
		t.Fatalf("proxy.list: %d proxies, want 2", len(page.Proxies))
	}
	for _, x := range page.Proxies {
		if !maps.Equal(x.Labels, want[x.ID]) {
			t.Errorf("proxy.list %s on %s: labels %v, want %v", x.ID, x.Target, x.Labels, want[x.ID])
		}
	}
}

// TestPlacementSpreadsByLabelWeights applies a pool that requires
// country de or us and spreads 80/20 over region: of five proxies four
// land on the eu targets and one on the us target, none on the target
// outside the required countries. Then a pool whose requirement no target
// meets says so in its Placed condition.
func TestPlacementSpreadsByLabelWeights(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "e1", Labels: map[string]string{"region": "eu", "country": "de"}})
	h.agent(agent.Info{Entry: "local", Target: "e2", Labels: map[string]string{"region": "eu", "country": "de"}})
	h.agent(agent.Info{Entry: "local", Target: "u1", Labels: map[string]string{"region": "us", "country": "us"}})
	h.agent(agent.Info{Entry: "local", Target: "x1", Labels: map[string]string{"region": "eu", "country": "fr"}})
	h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":5,
		"placement":{"require":{"country":["de","us"]},"spread":[{"label":"region","weights":{"eu":80,"us":20}}]}}`, nil)
	_, req := h.requested(5)
	per := map[string]int{}
	for _, d := range req {
		per[d.Target]++
		if d.Labels["country"] != "de" && d.Labels["country"] != "us" {
			t.Errorf("proxy on %s carries %v, want a required country", d.Target, d.Labels)
		}
	}
	if per["e1"]+per["e2"] != 4 || per["u1"] != 1 || per["x1"] != 0 {
		t.Errorf("proxies per target %v, want 4 on e1 and e2, 1 on u1, none on x1", per)
	}

	h.ok(poolApply, `{"name":"nowhere","provider":"local","size":1,"placement":{"require":{"country":["it"]}}}`, nil)
	c := h.waitCondition("nowhere", events.ConditionPlaced, events.ConditionFalse, events.ReasonNoTargetMatchesLabels, 10*time.Second)
	if !strings.Contains(c.Message, "country in [it]") || !strings.Contains(c.Message, "x1 (country=fr, region=eu)") {
		t.Errorf("Placed message %q does not name the required labels and what the targets carry", c.Message)
	}
}
