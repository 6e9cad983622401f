package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestProxyGetMatchesTheView: fleet.api.proxy.get (the planner's fold) and
// the proxy's key in fleet-proxies (health's projection) are one schema
// and converge on the same values, through a
// recycle (replacedBy, replaces) too.
func TestProxyGetMatchesTheView(t *testing.T) {
	f := startFleet(t)
	f.apply(events.PoolSpec{Name: "same", Provider: "local", Size: 2})
	ready := f.waitPool("same", 2, "ready", 60*time.Second)
	x := must(t, "proxy.recycle", func(ctx context.Context) (events.ProxyView, error) {
		return f.api.Recycle(ctx, api.ProxyRecycleRequest{ID: ready[0].ID})
	})
	if x.ReplacedBy == "" {
		t.Fatalf("recycle reply has no replacedBy: %+v", x)
	}
	ids := []string{ready[0].ID, ready[1].ID, x.ReplacedBy}
	for _, id := range ids {
		// The two readers follow the log at their own pace (a replacement
		// note, for one, does not move the replaced proxy's seq): they
		// must converge on the same value.
		var fold, view []byte
		converged := func() bool {
			var v events.ProxyView
			raw := f.views(bus.BucketProxies)[id]
			if raw == nil || json.Unmarshal(raw, &v) != nil {
				return false
			}
			a := must(t, "proxy.get "+id, func(ctx context.Context) (events.ProxyView, error) { return f.api.ProxyGet(ctx, id) })
			fold, view = canonical(t, a), canonical(t, v)
			return bytes.Equal(fold, view)
		}
		deadline := time.Now().Add(30 * time.Second)
		for !converged() {
			if time.Now().After(deadline) {
				t.Fatalf("proxy %s: the readers never agreed:\n proxy.get     %s\n fleet-proxies %s", id, fold, view)
			}
			time.Sleep(50 * time.Millisecond)
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
