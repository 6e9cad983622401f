package planner

import (
	"maps"
	"testing"

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
