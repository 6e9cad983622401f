package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/route"
)

func put(t *testing.T, kv jetstream.KeyValue, key string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(context.Background(), key, b); err != nil {
		t.Fatal(err)
	}
}

func bucket(t *testing.T, c *bus.Conn, name string) jetstream.KeyValue {
	t.Helper()
	kv, err := c.JS.KeyValue(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// TestFleetFollowsTheViews runs the gateway's NATS side on an embedded
// server: the views become the routing table, the pool's password sealed
// to the gateway's announced key opens, demand is written, suspects and
// bans are sent where health and the planner listen, and the micro
// service answers.
func TestFleetFollowsTheViews(t *testing.T) {
	conn := bustest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	pools, proxies := bucket(t, conn, bus.BucketPools), bucket(t, conn, bus.BucketProxies)
	creds, demand := bucket(t, conn, bus.BucketGatewayCreds), bucket(t, conn, bus.BucketDemand)

	// Present before the gateway starts: a pool with auth and ban rules,
	// a ready proxy, one still running, and a stale _recipient.
	put(t, pools, "p", map[string]any{"name": "p", "spec": events.PoolSpec{Name: "p", Provider: "local", Size: 2,
		Auth:    &events.ProxyAuth{Username: "crawl"},
		Gateway: &events.GatewaySpec{Strategy: events.StrategyLeastConnections, BanRules: []events.BanRule{{Name: "too-many", Status: []int{429}}}, Fallback: []string{"q"}}}})
	put(t, proxies, "p-a", events.ProxyView{ID: "p-a", Pool: "p", State: events.ProxyReady, Address: "127.0.0.1:1", Labels: map[string]string{"region": "eu", "country": "de"}})
	put(t, proxies, "p-b", events.ProxyView{ID: "p-b", Pool: "p", State: events.ProxyRunning, Address: "127.0.0.1:2"})
	if _, err := creds.Put(ctx, events.ProbeRecipientKey, []byte("not-this-gateway")); err != nil {
		t.Fatal(err)
	}

	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: "gw1", Key: key, DemandInterval: 200 * time.Millisecond, Listen: "127.0.0.1:8888"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil }})
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx, srv) }()
	select {
	case <-f.Synced():
	case err := <-done:
		t.Fatalf("Run: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("not synced within 20s")
	}
	if ids := table.IDs(); len(ids) != 1 || ids[0] != "p-a" {
		t.Errorf("routing table after sync: %v; want the ready p-a only", ids)
	}
	// The proxy's labels reach the table: a client selecting them is
	// served by p-a, one selecting others by none.
	if ready := table.Ready("p"); len(ready) != 1 || ready[0].Labels["region"] != "eu" || ready[0].Labels["country"] != "de" {
		t.Errorf("p-a in the table: %+v; want its labels region=eu, country=de", ready)
	}
	if x, err := table.Pick(route.Target{Pool: "p", Labels: []route.Label{{Name: "region", Value: "eu"}}}); err != nil || x.ID != "p-a" {
		t.Errorf("pick region=eu: %+v, %v; want p-a", x, err)
	} else {
		table.Done(x)
	}
	if !f.Known("p") || f.Known("q") || table.Spec("p").StrategyOrDefault() != events.StrategyLeastConnections || len(f.Rules("p")) != 1 {
		t.Errorf("pool p not loaded with its gateway settings")
	}
	e, err := creds.Get(ctx, events.ProbeRecipientKey)
	if err != nil || string(e.Value()) != seal.Public(key) {
		t.Fatalf("announced key %q, %v; want the gateway's", e.Value(), err)
	}
	// The pool demands a password the planner has not sealed yet.
	if _, _, err := f.Credentials(route.Proxy{ID: "p-a", Pool: "p"}); err == nil || !strings.Contains(err.Error(), "none is sealed") {
		t.Errorf("credentials before sealing: %v; want an error saying none is sealed", err)
	}
	// The planner seals it, as planner/probecreds.go does.
	plain, _ := json.Marshal(events.ProbeSecret{Pool: "p", Password: "pool-password-1"})
	box, err := seal.Seal(plain, seal.Public(key))
	if err != nil {
		t.Fatal(err)
	}
	put(t, creds, "p", events.ProbeCredential{Revision: 1, Sealed: *box})
	testwait.Until(t, 20*time.Second, "the sealed password to open", func() bool {
		u, pw, err := f.Credentials(route.Proxy{ID: "p-a", Pool: "p"})
		return err == nil && u == "crawl" && pw == "pool-password-1"
	})
	// A box copied under another pool's name does not open as its password.
	put(t, pools, "q", map[string]any{"name": "q", "spec": events.PoolSpec{Name: "q", Provider: "local", Size: 1, Auth: &events.ProxyAuth{Username: "crawl"}}})
	put(t, creds, "q", events.ProbeCredential{Revision: 1, Sealed: *box})
	testwait.Until(t, 20*time.Second, "q's copied box to be refused", func() bool {
		_, _, err := f.Credentials(route.Proxy{ID: "q-a", Pool: "q"})
		return err != nil && strings.Contains(err.Error(), `sealed for pool "p"`)
	})

	// Transitions: p-b gets ready, p-a leaves, p-b's key is deleted.
	put(t, proxies, "p-b", events.ProxyView{ID: "p-b", Pool: "p", State: events.ProxyReady, Address: "127.0.0.1:2"})
	put(t, proxies, "p-a", events.ProxyView{ID: "p-a", Pool: "p", State: events.ProxyUnhealthy, Address: "127.0.0.1:1"})
	testwait.Until(t, 20*time.Second, "p-b ready and p-a gone from the table", func() bool {
		ids := table.IDs()
		return len(ids) == 1 && ids[0] == "p-b"
	})
	if err := proxies.Delete(ctx, "p-b"); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "the deleted p-b gone from the table", func() bool { return len(table.IDs()) == 0 })

	// Demand: every known pool, zero without traffic.
	testwait.Until(t, 20*time.Second, "demand of pool p", func() bool {
		e, err := demand.Get(ctx, events.DemandKey("p", "gw1"))
		if err != nil {
			return false
		}
		var d events.GatewayDemand
		return json.Unmarshal(e.Value(), &d) == nil && d.Pool == "p" && d.Gateway == "gw1" && d.Connections == 0 && time.Since(d.At) < 10*time.Second
	})

	// Suspects reach health's subject; bans the planner's API.
	sus, err := conn.NC.SubscribeSync(events.SuspectSubject)
	if err != nil {
		t.Fatal(err)
	}
	bans := make(chan string, 1)
	if _, err := conn.NC.Subscribe(events.APISubject(api.NounProxy, api.VerbReportBan), func(m *nats.Msg) {
		bans <- string(m.Data)
		_ = m.Respond([]byte(`{}`))
	}); err != nil {
		t.Fatal(err)
	}
	f.Suspect("p-a", "gateway: dial refused")
	if m, err := sus.NextMsg(10 * time.Second); err != nil || !strings.Contains(string(m.Data), `"id":"p-a"`) {
		t.Errorf("suspect report: %v %v", m, err)
	}
	f.Banned("p", ban.Verdict{Proxy: "p-a", Rule: "too-many", Matches: 5})
	select {
	case b := <-bans:
		if b != `{"id":"p-a","reason":"too-many"}` {
			t.Errorf("report-ban body %s", b)
		}
	case <-time.After(10 * time.Second):
		t.Error("no report-ban request")
	}

	// The micro service.
	m, err := conn.NC.Request(events.GatewaySubject("gw1", events.GatewayInfo), nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var info Info
	if err := json.Unmarshal(m.Data, &info); err != nil || info.Name != "gw1" || info.Key != seal.Public(key) || info.Pools["p"].Credentials != "ok" || info.Pools["p"].Strategy != events.StrategyLeastConnections ||
		!slices.Equal(info.Pools["p"].Fallback, []string{"q"}) || info.Pools["p"].TierMemory != "10m0s" {
		t.Errorf("info: %s", m.Data)
	}
	if m, err := conn.NC.Request(events.GatewaySubject("gw1", events.GatewayStats), nil, 10*time.Second); err != nil || !strings.Contains(string(m.Data), `"name":"gw1"`) {
		t.Errorf("stats: %v %v", m, err)
	}

	// A deleted pool is forgotten, and its demand no longer written.
	if err := pools.Delete(ctx, "q"); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "pool q forgotten", func() bool { return !f.Known("q") })
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after cancel: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Error("Run did not return after cancel")
	}
}

func TestCheckName(t *testing.T) {
	for _, ok := range []string{"gw1", "host-8888", "a_b"} {
		if err := CheckName(ok); err != nil {
			t.Errorf("CheckName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", "a.b", "a b", "a*", strings.Repeat("x", 65)} {
		if err := CheckName(bad); err == nil {
			t.Errorf("CheckName(%q): nil; want an error", bad)
		}
	}
}

// logLines records the lines a slog.Logger writes.
type logLines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// TestBanReports: a ban report is retried while the planner fails or does
// not answer, not after a refusal, and Run waits for the reports in
// flight when it stops.
func TestBanReports(t *testing.T) {
	conn := bustest.Start(t)
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	// The planner's report-ban: p-flaky fails twice, then is retired;
	// p-gone is unknown; p-slow is never answered.
	var mu sync.Mutex
	attempts := map[string]int{}
	release := make(chan struct{})
	svc, err := micro.AddService(conn.NC, micro.Config{Name: "fleet-planner", Version: "0.0.0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = svc.Stop() }()
	err = svc.AddEndpoint("proxy-report-ban", micro.HandlerFunc(func(req micro.Request) {
		var ban api.ProxyBanRequest
		_ = json.Unmarshal(req.Data(), &ban)
		mu.Lock()
		attempts[ban.ID]++
		n := attempts[ban.ID]
		mu.Unlock()
		switch {
		case ban.ID == "p-slow":
			go func() {
				<-release
				_ = req.RespondJSON(events.ProxyView{ID: ban.ID})
			}()
		case ban.ID == "p-gone":
			aerr := &api.APIError{Status: "422", Code: api.CodeNotFound, Message: `id: unknown proxy "p-gone"`}
			_ = req.Error(aerr.Status, aerr.Message, api.ErrorBody(aerr))
		case n < 3:
			aerr := &api.APIError{Status: "500", Code: api.CodeInternal, Message: "could not record the decision; retry"}
			_ = req.Error(aerr.Status, aerr.Message, api.ErrorBody(aerr))
		default:
			_ = req.RespondJSON(events.ProxyView{ID: ban.ID, State: events.ProxyRetiring, Reason: "banned: " + ban.Reason})
		}
	}), micro.WithEndpointSubject(events.APISubject(api.NounProxy, api.VerbReportBan)))
	if err != nil {
		t.Fatal(err)
	}
	defer close(release)

	var logs logLines
	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: "gw1", Key: key}, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	f.banBackoff = 10 * time.Millisecond
	srv := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil }})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx, srv) }()

	count := func(id string) int {
		mu.Lock()
		defer mu.Unlock()
		return attempts[id]
	}
	f.Banned("p", ban.Verdict{Proxy: "p-flaky", Rule: "captcha"})
	f.Banned("p", ban.Verdict{Proxy: "p-gone", Rule: "captcha"})
	f.Banned("p", ban.Verdict{Proxy: "p-slow", Rule: "captcha"})
	testwait.Until(t, 20*time.Second, "p-flaky reported", func() bool { return strings.Contains(logs.String(), `msg="proxy reported banned" proxy=p-flaky`) })
	testwait.Until(t, 20*time.Second, "p-gone given up", func() bool {
		return strings.Contains(logs.String(), `msg="report a banned proxy; it is reported again when its responses match the rule again" proxy=p-gone`)
	})
	testwait.Until(t, 20*time.Second, "p-slow sent", func() bool { return count("p-slow") == 1 })
	if n := count("p-flaky"); n != 3 {
		t.Errorf("p-flaky: %d attempts, want 3 (two failures, then the report)", n)
	}
	if n := count("p-gone"); n != 1 {
		t.Errorf("p-gone: %d attempts, want 1: a refusal is not retried", n)
	}

	// Stopping cancels p-slow's request, and Run returns after it ended.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run after cancel: %v", err)
		}
	case <-time.After(banRequestTimeout / 2):
		t.Fatal("Run did not return after cancel; the ban report's request does not follow the context")
	}
	if !strings.Contains(logs.String(), `proxy=p-slow pool=p rule=captcha err="context canceled"`) {
		t.Errorf("Run returned before the p-slow report ended; log:\n%s", logs.String())
	}
	if n := count("p-slow"); n != 1 {
		t.Errorf("p-slow: %d attempts, want 1: a report is not retried once the gateway stops", n)
	}
}

// TestReloadKeepsProxiesWhoseKeysAreBeingRewritten: a watch's initial
// values can end before a key rewritten meanwhile (bus.Held). While three
// ready proxies' values are rewritten as fast as they can be, every reload
// of the proxies view still has all three in the routing table when its
// reset is done; a proxy whose key was deleted and its marker cleaned up
// while no watch ran is dropped by the next reload.
func TestReloadKeepsProxiesWhoseKeysAreBeingRewritten(t *testing.T) {
	conn := bustest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	proxies := bucket(t, conn, bus.BucketProxies)
	ids := []string{"p-a", "p-b", "p-c"}
	view := func(id string) events.ProxyView {
		return events.ProxyView{ID: id, Pool: "p", State: events.ProxyReady, Address: "127.0.0.1:1"}
	}
	for _, id := range ids {
		put(t, proxies, id, view(id))
	}
	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: "gw1", Key: key}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	b := bucketWatch{proxies, f.applyProxy, f.resetProxies}
	reload := func() []string {
		t.Helper()
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		var got []string
		// The watch lives in lctx: once it ends, its updates may end
		// first (ErrWatchEnded).
		if err := f.load(lctx, b, func() { got = table.IDs(); lcancel() }); err != nil && lctx.Err() == nil {
			t.Fatalf("load: %v", err)
		}
		slices.Sort(got)
		return got
	}
	if got := reload(); !slices.Equal(got, ids) {
		t.Fatalf("first load: table %v, want %v", got, ids)
	}

	body := map[string][]byte{}
	for _, id := range ids {
		body[id], _ = json.Marshal(view(id))
	}
	halt := bustest.Rewriters(t, ids, func(id string) error {
		_, err := proxies.Put(ctx, id, body[id])
		return err
	})
	for i := range 200 {
		if got := reload(); !slices.Equal(got, ids) {
			t.Fatalf("reload %d while the proxies' values are rewritten: table %v at the end of its initial values, want %v", i, got, ids)
		}
	}
	halt()

	if err := proxies.Delete(ctx, "p-c"); err != nil {
		t.Fatal(err)
	}
	if err := proxies.PurgeDeletes(ctx, jetstream.DeleteMarkersOlderThan(-1)); err != nil {
		t.Fatal(err)
	}
	if got, want := reload(), []string{"p-a", "p-b"}; !slices.Equal(got, want) {
		t.Errorf("reload after p-c was deleted: table %v, want %v", got, want)
	}
}
