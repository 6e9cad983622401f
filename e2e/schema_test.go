package e2e_test

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestProxyGetMatchesTheView: fleet.api.proxy.get (the planner's fold) and
// the proxy's key in fleet-proxies (health's projection) are one schema
// with the same values once both have applied the same events, through a
// recycle (replacedBy, replaces) too.
func TestProxyGetMatchesTheView(t *testing.T) {
	f := newFleet(t)
	f.dumpLogsOnFailure()
	f.startAll()
	f.mustReq("fleet.api.pool.apply", `{"name":"same","provider":"local","size":2}`)
	ready := f.waitPool("same", 2, "ready", 60*time.Second)
	var x events.ProxyView
	parseJSON(t, f.mustReq("fleet.api.proxy.recycle", `{"id":"`+ready[0].ID+`"}`), &x)
	if x.ReplacedBy == "" {
		t.Fatalf("recycle reply has no replacedBy: %+v", x)
	}
	ids := []string{ready[0].ID, ready[1].ID, x.ReplacedBy}
	for _, id := range ids {
		var api, view []byte
		waitFor(t, 30*time.Second, "proxy.get and fleet-proxies at the same event for "+id, func() bool {
			var a, v events.ProxyView
			raw := f.views(bus.BucketProxies)[id]
			if raw == nil || json.Unmarshal(raw, &v) != nil {
				return false
			}
			parseJSON(t, f.mustReq("fleet.api.proxy.get", `{"id":"`+id+`"}`), &a)
			if a.Seq != v.Seq {
				return false
			}
			api, view = canonical(t, a), canonical(t, v)
			return true
		})
		if !bytes.Equal(api, view) {
			t.Errorf("proxy %s:\n proxy.get     %s\n fleet-proxies %s", id, api, view)
		}
	}
}

// canonical re-encodes a view so that equal values give equal bytes.
func canonical(t *testing.T, v events.ProxyView) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
