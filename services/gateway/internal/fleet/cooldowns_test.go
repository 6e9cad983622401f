package fleet

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/bantest"
	"proxyfleet/services/gateway/internal/cooldown"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/route"
)

// The test proxies p-a and p-b reach sites from these addresses.
const (
	fromA = "127.0.0.2"
	fromB = "127.0.0.3"
)

// gateway is one running gateway: its fleet view, cooldowns and client
// endpoint.
type gateway struct {
	cooldowns *cooldown.Set
	client    *http.Client
	stop      func()
}

// startGateway runs a gateway named name on conn until stop or the end of
// the test, and waits until it synced; tweak, when not nil, adjusts its
// Fleet first.
func startGateway(t *testing.T, conn *bus.Conn, name string, tweak func(*Fleet)) *gateway {
	t.Helper()
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	table := route.NewTable(route.Limits{}, nil)
	set := cooldown.NewSet(time.Hour, nil)
	f, err := New(conn, table, Config{Name: name, Key: key, Cooldowns: set}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if tweak != nil {
		tweak(f)
	}
	srv := forward.New(forward.Config{Table: table, Fleet: f, Cooldowns: set, Auth: func(string, string, string) (bool, error) { return true, nil }})
	front := httptest.NewServer(srv)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx, srv) }()
	stop := func() {
		cancel()
		<-done
		front.Close()
		srv.Close()
	}
	t.Cleanup(func() {
		if ctx.Err() == nil {
			stop()
		}
	})
	select {
	case <-f.Synced():
	case err := <-done:
		t.Fatalf("gateway %s: Run: %v", name, err)
	case <-time.After(20 * time.Second):
		t.Fatalf("gateway %s not synced within 20s", name)
	}
	testwait.Until(t, 20*time.Second, "the gateway's routing table", func() bool { return len(table.IDs()) == 2 })
	u, _ := url.Parse(front.URL)
	u.User = url.UserPassword("p", "x")
	tr := &http.Transport{Proxy: http.ProxyURL(u)}
	t.Cleanup(tr.CloseIdleConnections)
	return &gateway{cooldowns: set, client: &http.Client{Transport: tr, Timeout: 20 * time.Second}, stop: stop}
}

func (g *gateway) get(t *testing.T, u string) int {
	t.Helper()
	resp, err := g.client.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

func (g *gateway) cooled(site string) []string {
	ids, _ := g.cooldowns.Cooled("p", site)
	slices.Sort(ids)
	return ids
}

// coolingPool puts pool p, whose 403s cool a proxy for the site, with
// ready proxies p-a and p-b.
func coolingPool(t *testing.T, conn *bus.Conn) {
	t.Helper()
	pools, proxies := bucket(t, conn, bus.BucketPools), bucket(t, conn, bus.BucketProxies)
	put(t, pools, "p", map[string]any{"name": "p", "spec": events.PoolSpec{Name: "p", Provider: "local", Size: 2,
		Gateway: &events.GatewaySpec{BanRules: []events.BanRule{{Name: "blocked", Status: []int{403}, Action: events.BanActionCooldown}}}}})
	put(t, proxies, "p-a", events.ProxyView{ID: "p-a", Pool: "p", State: events.ProxyReady, Address: bantest.Proxy(t, fromA)})
	put(t, proxies, "p-b", events.ProxyView{ID: "p-b", Pool: "p", State: events.ProxyReady, Address: bantest.Proxy(t, fromB)})
}

// TestCooldownsAreShared: a cooldown one gateway decides reaches the
// bucket and the other gateways, which keep the proxy off the site
// without a ban page of their own; a restarted gateway has it before it
// serves; a cooldown ends at its until, whoever wrote it.
func TestCooldownsAreShared(t *testing.T) {
	conn := bustest.Start(t)
	ctx := context.Background()
	cools := bucket(t, conn, bus.BucketGatewayCooldowns)
	coolingPool(t, conn)
	banning := bantest.NewSite(t, "127.0.0.10", fromA)
	const site = "127.0.0.10"

	gw1 := startGateway(t, conn, "gw1", nil)
	gw2 := startGateway(t, bustest.Dial(t, conn), "gw2", nil)

	// gw1 meets the ban page, retries on p-b and cools p-a for the site.
	for banning.Seen(fromA) == 0 {
		if code := gw1.get(t, banning.URL); code != 200 {
			t.Fatalf("gw1: %d; want p-b's 200", code)
		}
	}
	testwait.Until(t, 20*time.Second, "gw1's cooldown in the bucket", func() bool {
		e, err := cools.Get(ctx, events.CooldownKey("p-a", site))
		if err != nil {
			return false
		}
		var v events.GatewayCooldown
		_ = json.Unmarshal(e.Value(), &v)
		return v.Proxy == "p-a" && v.Pool == "p" && v.Site == site && v.Rule == "blocked" && v.Gateway == "gw1" &&
			v.Until.Sub(v.At) == events.DefaultBanCooldown
	})
	testwait.Until(t, 20*time.Second, "gw2 to learn gw1's cooldown", func() bool { return slices.Equal(gw2.cooled(site), []string{"p-a"}) })
	m, err := conn.NC.Request(events.GatewaySubject("gw2", events.GatewayInfo), nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var info Info
	if err := json.Unmarshal(m.Data, &info); err != nil || !slices.Equal(info.Pools["p"].Cooled[site], []string{"p-a"}) {
		t.Errorf("gw2's info: %s; want p-a cooled for %s", m.Data, site)
	}
	for range 4 {
		if code := gw2.get(t, banning.URL); code != 200 {
			t.Fatalf("gw2: %d; want 200", code)
		}
	}
	if n := banning.Seen(fromA); n != 1 {
		t.Errorf("the site saw p-a %d times; want once: gw2 must not send it there again", n)
	}

	// A restarted gateway has the cooldown before it serves.
	gw2.stop()
	gw3 := startGateway(t, bustest.Dial(t, conn), "gw2", nil)
	if got := gw3.cooled(site); !slices.Equal(got, []string{"p-a"}) {
		t.Errorf("the restarted gateway, synced, holds cooldowns %v for the site; want [p-a]", got)
	}
	for range 4 {
		gw3.get(t, banning.URL)
	}
	if n := banning.Seen(fromA); n != 1 {
		t.Errorf("the site saw p-a %d times after the restart; want still once", n)
	}

	// Cooldowns another gateway wrote: one that ended is ignored, one
	// that ends soon holds until its until, then p-a serves the site again.
	ended := bantest.NewSite(t, "127.0.0.11")
	soon := bantest.NewSite(t, "127.0.0.12")
	now := time.Now()
	put(t, cools, events.CooldownKey("p-a", "127.0.0.11"), events.GatewayCooldown{Proxy: "p-a", Pool: "p", Site: "127.0.0.11", Rule: "blocked",
		Gateway: "other", At: now.Add(-2 * time.Hour), Until: now.Add(-time.Hour)})
	until := now.Add(2 * time.Second)
	put(t, cools, events.CooldownKey("p-a", "127.0.0.12"), events.GatewayCooldown{Proxy: "p-a", Pool: "p", Site: "127.0.0.12", Rule: "blocked",
		Gateway: "other", At: now, Until: until})
	testwait.Until(t, 20*time.Second, "gw1 to learn the coming cooldown", func() bool { return slices.Equal(gw1.cooled("127.0.0.12"), []string{"p-a"}) })
	for range 4 {
		gw1.get(t, ended.URL)
	}
	if ended.Seen(fromA) == 0 {
		t.Error("p-a was kept off a site whose cooldown ended an hour ago")
	}
	testwait.Until(t, 20*time.Second, "p-a to serve the site once its cooldown ended", func() bool {
		gw1.get(t, soon.URL)
		if soon.Seen(fromA) == 0 {
			return false
		}
		if time.Now().Before(until) {
			t.Errorf("p-a served the site before its cooldown ended")
		}
		return true
	})

	// Deleting the key ends a cooldown at once.
	if err := cools.Delete(ctx, events.CooldownKey("p-a", site)); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "the deleted cooldown to end", func() bool { return len(gw1.cooled(site)) == 0 && len(gw3.cooled(site)) == 0 })
}

// TestCooldownsWithoutTheBucket: a gateway that cannot open the bucket
// still syncs, serves and keeps the cooldowns it decides; once the bucket
// exists it learns the others' and shares its own.
func TestCooldownsWithoutTheBucket(t *testing.T) {
	conn := bustest.Start(t)
	ctx := context.Background()
	if err := conn.JS.DeleteKeyValue(ctx, bus.BucketGatewayCooldowns); err != nil {
		t.Fatal(err)
	}
	coolingPool(t, conn)
	first := bantest.NewSite(t, "127.0.0.10", fromA)
	gw := startGateway(t, conn, "gw1", func(f *Fleet) { f.cooldownRetry = 50 * time.Millisecond })
	for range 4 {
		if code := gw.get(t, first.URL); code != 200 {
			t.Fatalf("%d; want 200", code)
		}
	}
	if n := first.Seen(fromA); n != 1 {
		t.Errorf("the site saw p-a %d times; want once: the gateway keeps its own cooldowns without the bucket", n)
	}

	if err := bus.EnsureTopology(ctx, conn); err != nil {
		t.Fatal(err)
	}
	cools := bucket(t, conn, bus.BucketGatewayCooldowns)
	now := time.Now()
	put(t, cools, events.CooldownKey("p-a", "127.0.0.11"), events.GatewayCooldown{Proxy: "p-a", Pool: "p", Site: "127.0.0.11", Rule: "blocked",
		Gateway: "other", At: now, Until: now.Add(time.Hour)})
	testwait.Until(t, 20*time.Second, "the gateway to learn another's cooldown once the bucket exists", func() bool {
		return slices.Equal(gw.cooled("127.0.0.11"), []string{"p-a"})
	})
	second := bantest.NewSite(t, "127.0.0.12", fromA)
	for second.Seen(fromA) == 0 {
		gw.get(t, second.URL)
	}
	testwait.Until(t, 20*time.Second, "the gateway's next cooldown in the bucket", func() bool {
		_, err := cools.Get(ctx, events.CooldownKey("p-a", "127.0.0.12"))
		return err == nil
	})
}
