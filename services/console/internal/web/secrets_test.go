package web

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/console/internal/fleetview"
)

// TestNoSecretRendered writes pools whose view holds a password,
// user-data and external proxies with credentials in their URLs (as a
// view must never hold them, but a buggy or older writer might), follows
// them through the KV watch, and reads every page, live update and
// confirmation page: none holds a secret. The external proxies still show,
// without their credentials.
func TestNoSecretRendered(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	conn := bustest.Start(t)
	f := newFixture(t, nil)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = fleetview.NewFollower(conn.JS, f.store, time.Second, nil).Run(rctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	secrets := []string{"hunter2-pool-password", "#cloud-config-user-data-secret", "vendorpass-42", "alice-secret-user", "s3cret"}
	owned := events.PoolSpec{Name: "owned", Provider: "local", Size: 1, Port: 3128,
		Auth: &events.ProxyAuth{Username: "crawler", Password: "hunter2-pool-password"}, UserData: "#cloud-config-user-data-secret"}
	external := events.PoolSpec{Name: "bought", Provider: events.ProviderExternal, Size: 2, External: &events.External{Proxies: []events.ExternalProxy{
		{URL: "http://alice-secret-user:vendorpass-42@eu1.vendor-a.example:3128"},
		{URL: "http://bob:s3cret@us1.vendor-a.example:3128"},
	}}}
	kv, err := conn.JS.KeyValue(ctx, bus.BucketPools)
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []events.PoolSpec{owned, external} {
		b, err := json.Marshal(map[string]any{"name": spec.Name, "provider": spec.Provider, "size": spec.Size, "revision": 1, "spec": spec, "secretsDigest": "abc"})
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), "hunter2") == (spec.Name != "owned") {
			t.Fatalf("the test's view of %s does not hold its secrets: %s", spec.Name, b)
		}
		if _, err := kv.Put(ctx, spec.Name, b); err != nil {
			t.Fatal(err)
		}
	}
	pk, err := conn.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	// A reason quoting a URL with a password (no writer should) is shown
	// without it.
	b, _ := json.Marshal(events.ProxyView{ID: "owned-a", Pool: "owned", State: events.ProxyUnhealthy, Username: "crawler", Address: "127.0.0.1:20000",
		Reason: "proxyconnect tcp: http://crawler:hunter2-pool-password@127.0.0.1:20000: refused"})
	if _, err := pk.Put(ctx, "owned-a", b); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "the pools in the console", func() bool {
		_, ok1 := f.store.Pool("owned", time.Now())
		_, ok2 := f.store.Pool("bought", time.Now())
		return ok1 && ok2 && f.store.PoolOf("owned-a") == "owned"
	})

	c := f.client(t)
	var pages []string
	for _, path := range []string{"/", "/pools/owned", "/pools/bought", "/targets", "/events", "/gateway"} {
		resp, body := c.get(path)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %s", path, resp.Status)
		}
		pages = append(pages, body)
	}
	_, page := c.get("/pools/owned")
	_, confirm := c.post("/pools/owned/scale", map[string][]string{"csrf": {csrfOf(t, page)}, "replicas": {"3"}})
	pages = append(pages, confirm)
	_, refused := c.post("/pools/owned/scale", map[string][]string{"csrf": {csrfOf(t, page)}, "replicas": {"3"}, "confirm": {"yes"}})
	pages = append(pages, refused)
	if !strings.Contains(refused, "password, user-data or credentials") {
		t.Errorf("scaling a pool with secrets is not refused with the reason:\n%s", refused)
	}
	if calls := f.api.Calls(); len(calls) != 0 {
		t.Errorf("scaling a pool with secrets reached the API: %v", calls)
	}
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	for _, path := range []string{"/live/", "/live/pools/owned", "/live/pools/bought"} {
		pages = append(pages, c.live(lctx, path).next(t, 5*time.Second))
	}
	for i, p := range pages {
		for _, s := range secrets {
			if strings.Contains(p, s) {
				t.Errorf("page %d shows the secret %q", i, s)
			}
		}
	}
	if !strings.Contains(pages[2], "http://eu1.vendor-a.example:3128") {
		t.Errorf("the external pool's page does not list its proxies without credentials")
	}
	if !strings.Contains(pages[1], "user crawler (password kept secret)") {
		t.Errorf("the owned pool's page does not say it has a user")
	}
}
