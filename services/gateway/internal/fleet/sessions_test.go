package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/route"
)

// sessionFleet puts pool p with gw as its gateway spec and three ready
// proxies p-a, p-b, p-c into the views.
func sessionFleet(t *testing.T, conn *bus.Conn, gw *events.GatewaySpec) {
	t.Helper()
	put(t, bucket(t, conn, bus.BucketPools), "p", map[string]any{"name": "p", "spec": events.PoolSpec{Name: "p", Provider: "local", Size: 3, Gateway: gw}})
	proxies := bucket(t, conn, bus.BucketProxies)
	for i, id := range []string{"p-a", "p-b", "p-c"} {
		put(t, proxies, id, events.ProxyView{ID: id, Pool: "p", State: events.ProxyReady, Address: "127.0.0.1:" + string(rune('1'+i))})
	}
}

// sessionGateway is one gateway's table and fleet view, running on conn.
type sessionGateway struct {
	table *route.Table
	stop  func()
}

// startSessionGateway runs a gateway named name on conn until the test ends (or
// stop) and waits until it is synced.
func startSessionGateway(t *testing.T, conn *bus.Conn, name string) *sessionGateway {
	t.Helper()
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: name, Key: key}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx, srv) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("gateway %s: Run: %v", name, err)
			}
		case <-time.After(20 * time.Second):
			t.Errorf("gateway %s: Run did not return after cancel", name)
		}
	}
	t.Cleanup(stop)
	select {
	case <-f.Synced():
	case err := <-done:
		t.Fatalf("gateway %s: Run: %v", name, err)
	case <-time.After(20 * time.Second):
		t.Fatalf("gateway %s: not synced within 20s", name)
	}
	testwait.Until(t, 20*time.Second, name+" to see the three proxies", func() bool { return len(table.Ready("p")) == 3 })
	return &sessionGateway{table: table, stop: stop}
}

// pick is one connection of target through g, ended at once.
func (g *sessionGateway) pick(t *testing.T, target route.Target, exclude ...string) string {
	t.Helper()
	x, err := g.table.Pick(target, exclude...)
	if err != nil {
		t.Fatal(err)
	}
	g.table.Done(x)
	return x.ID
}

// sessionOn waits until g holds session s of pool p on proxy.
func (g *sessionGateway) sessionOn(t *testing.T, what, s, proxy string) {
	t.Helper()
	testwait.Until(t, 20*time.Second, what, func() bool {
		st, ok := g.table.Session("p", s)
		return ok && st.Proxy == proxy
	})
}

// storedSession waits until the bucket holds session s of pool p on proxy.
func storedSession(t *testing.T, kv jetstream.KeyValue, s, proxy string) {
	t.Helper()
	testwait.Until(t, 20*time.Second, "session "+s+" on "+proxy+" in the bucket", func() bool {
		e, err := kv.Get(context.Background(), "p."+s)
		return err == nil && jsonField(e.Value(), "proxy") == proxy
	})
}

var (
	plain   = route.Target{Pool: "p", Client: "10.0.0.1"}
	session = route.Target{Pool: "p", Session: "s1", Client: "10.0.0.1"}
)

// TestTwoGatewaysServeOneSessionOnOneProxy: a session pinned by one
// gateway is served by another on the same proxy, a move by either is
// followed by the other, and the uses of both count towards rotation.
func TestTwoGatewaysServeOneSessionOnOneProxy(t *testing.T) {
	conn := bustest.Start(t)
	sessionFleet(t, conn, &events.GatewaySpec{Session: &events.SessionRotation{MaxRequests: 10}})
	gw1 := startSessionGateway(t, conn, "gw1")
	gw2 := startSessionGateway(t, bustest.Dial(t, conn), "gw2")

	// gw1 pins s1 to p-b (its round-robin is past p-a); gw2 on its own
	// would pin it to p-a.
	if x := gw1.pick(t, plain); x != "p-a" {
		t.Fatalf("gw1's first plain pick: %s", x)
	}
	if x := gw1.pick(t, session); x != "p-b" {
		t.Fatalf("gw1 pinned s1 to %s, want p-b", x)
	}
	gw2.sessionOn(t, "gw2 to learn s1 on p-b", "s1", "p-b")
	if x := gw2.pick(t, session); x != "p-b" {
		t.Fatalf("gw2 served s1 on %s, want p-b as gw1 does", x)
	}
	// p-b fails a request on gw2: the session moves there, and gw1 follows.
	moved := gw2.pick(t, session, "p-b")
	if moved == "p-b" {
		t.Fatal("gw2 kept s1 on the excluded p-b")
	}
	gw1.sessionOn(t, "gw1 to follow the move of s1 to "+moved, "s1", moved)
	// Uses on both gateways count towards maxRequests 10: 4 here, then 5
	// there (the move was the first).
	for range 4 {
		gw2.pick(t, session)
	}
	testwait.Until(t, 20*time.Second, "gw1 to learn gw2's 5 uses", func() bool {
		st, ok := gw1.table.Session("p", "s1")
		return ok && st.Uses == 5
	})
	for i := range 5 {
		if x := gw1.pick(t, session); x != moved {
			t.Fatalf("gw1's use %d of s1 went to %s, want %s", 6+i, x, moved)
		}
	}
	gw2.sessionOn(t, "gw2 to learn gw1's uses", "s1", moved)
	testwait.Until(t, 20*time.Second, "gw2 to count 10 uses", func() bool {
		st, ok := gw2.table.Session("p", "s1")
		return ok && st.Uses == 10
	})
	rotated := gw2.pick(t, session)
	if rotated == moved {
		t.Fatalf("the 11th use of s1 stayed on %s; want a rotation after 10 uses across both gateways", moved)
	}
	gw1.sessionOn(t, "gw1 to follow the rotation", "s1", rotated)

	// The info endpoint shows the rotation and the session.
	m, err := conn.NC.Request(events.GatewaySubject("gw1", events.GatewayInfo), nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var info Info
	if err := json.Unmarshal(m.Data, &info); err != nil || info.Pools["p"].Session == nil || info.Pools["p"].Session.MaxRequests != 10 || info.Pools["p"].Sessions != 1 {
		t.Errorf("info: %s", m.Data)
	}
}

// TestRestartedGatewayKeepsItsSessions: a gateway started again loads the
// sessions from the bucket and serves them on the same proxy.
func TestRestartedGatewayKeepsItsSessions(t *testing.T) {
	conn := bustest.Start(t)
	sessionFleet(t, conn, nil)
	kv := bucket(t, conn, bus.BucketGatewaySessions)
	gw := startSessionGateway(t, conn, "gw1")
	gw.pick(t, plain)
	if x := gw.pick(t, session); x != "p-b" {
		t.Fatalf("pinned s1 to %s, want p-b", x)
	}
	storedSession(t, kv, "s1", "p-b")
	gw.stop()

	again := startSessionGateway(t, conn, "gw1")
	if x := again.pick(t, session); x != "p-b" {
		t.Fatalf("the restarted gateway served s1 on %s, want p-b (a fresh pin would be p-a)", x)
	}
}

// TestExpiredSessionIsForgotten: a session past its TTL leaves the bucket
// and every gateway; a gateway started later pins it afresh.
func TestExpiredSessionIsForgotten(t *testing.T) {
	conn := bustest.Start(t)
	sessionFleet(t, conn, &events.GatewaySpec{SessionTTL: events.Duration(time.Second)})
	kv := bucket(t, conn, bus.BucketGatewaySessions)
	gw1 := startSessionGateway(t, conn, "gw1")
	gw2 := startSessionGateway(t, bustest.Dial(t, conn), "gw2")
	gw1.pick(t, plain)
	if x := gw1.pick(t, session); x != "p-b" {
		t.Fatalf("pinned s1 to %s, want p-b", x)
	}
	storedSession(t, kv, "s1", "p-b")
	gw2.sessionOn(t, "gw2 to learn s1", "s1", "p-b")
	testwait.Until(t, 20*time.Second, "s1 to expire from the bucket", func() bool {
		_, err := kv.Get(context.Background(), "p.s1")
		return errors.Is(err, jetstream.ErrKeyNotFound)
	})
	for _, g := range []*sessionGateway{gw1, gw2} {
		if n := g.table.Sessions("p"); n != 0 {
			t.Errorf("a gateway still holds %d sessions after their TTL", n)
		}
	}
	gw3 := startSessionGateway(t, conn, "gw3")
	if x := gw3.pick(t, session); x != "p-a" {
		t.Fatalf("a gateway started after s1 expired served it on %s; want a fresh pin (p-a)", x)
	}
}

// jsonField is the string field name of the JSON object b ("" when none).
func jsonField(b []byte, name string) string {
	var m map[string]any
	if json.Unmarshal(b, &m) != nil {
		return ""
	}
	s, _ := m[name].(string)
	return s
}

// TestGatewayServesWithoutTheSessionsBucket: a gateway the servers keep
// from fleet-gateway-sessions (refused outright, or allowed to open it
// but not to watch it) still syncs and serves sessions of its own.
func TestGatewayServesWithoutTheSessionsBucket(t *testing.T) {
	kvAPI := "KV_" + bus.BucketGatewaySessions
	for name, deny := range map[string][]string{
		"bucket refused": {"$JS.API.STREAM.INFO." + kvAPI, "$JS.API.CONSUMER.*." + kvAPI + ".>", "$KV." + bus.BucketGatewaySessions + ".>"},
		"watch refused":  {"$JS.API.CONSUMER.CREATE." + kvAPI + ".>", "$JS.API.CONSUMER.CREATE." + kvAPI, "$KV." + bus.BucketGatewaySessions + ".>"},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := testwait.Context(t, 60*time.Second)
			admin, gateway := permittedFleet(t, ctx, &server.SubjectPermission{Allow: []string{">"}, Deny: deny})
			gw := startSessionGateway(t, gateway(), "gw1")
			first := gw.pick(t, session)
			if x := gw.pick(t, session); x != first {
				t.Fatalf("session moved from %s to %s without its bucket", first, x)
			}
			if _, err := bucket(t, admin, bus.BucketGatewaySessions).Get(ctx, "p.s1"); !errors.Is(err, jetstream.ErrKeyNotFound) {
				t.Fatalf("a gateway refused the bucket wrote to it: %v", err)
			}
		})
	}
}

// sessionPermissions is every subject a gateway publishes to for
// fleet-gateway-sessions: bind the bucket, watch it (an ordered consumer,
// its flow control, deleted when the watch stops) and write its keys
// "<pool>.<session id>". No read by key.
var sessionPermissions = []string{
	"$JS.API.STREAM.INFO.KV_" + bus.BucketGatewaySessions,
	"$JS.API.CONSUMER.CREATE.KV_" + bus.BucketGatewaySessions + ".>",
	"$JS.API.CONSUMER.DELETE.KV_" + bus.BucketGatewaySessions + ".*",
	"$JS.FC.KV_" + bus.BucketGatewaySessions + ".>",
	"$KV." + bus.BucketGatewaySessions + ".*.*",
}

// TestSessionsNeedOnlyTheirPermissions: two gateways allowed no more of
// fleet-gateway-sessions than sessionPermissions share a session.
func TestSessionsNeedOnlyTheirPermissions(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	allow := []string{"fleet.>", "$SRV.>", "_INBOX.>", "$JS.API.INFO"}
	for _, b := range []string{bus.BucketProxies, bus.BucketPools, bus.BucketGatewayCreds, bus.BucketDemand} {
		allow = append(allow, "$JS.API.STREAM.INFO.KV_"+b, "$JS.API.CONSUMER.CREATE.KV_"+b+".>", "$JS.API.CONSUMER.DELETE.KV_"+b+".*",
			"$JS.API.DIRECT.GET.KV_"+b, "$JS.API.DIRECT.GET.KV_"+b+".>", "$JS.API.STREAM.MSG.GET.KV_"+b, "$JS.FC.KV_"+b+".>", "$KV."+b+".>")
	}
	allow = append(allow, sessionPermissions...)
	admin, gateway := permittedFleet(t, ctx, &server.SubjectPermission{Allow: allow})
	gw1 := startSessionGateway(t, gateway(), "gw1")
	gw2 := startSessionGateway(t, gateway(), "gw2")
	gw1.pick(t, plain)
	if x := gw1.pick(t, session); x != "p-b" {
		t.Fatalf("gw1 pinned s1 to %s, want p-b", x)
	}
	storedSession(t, bucket(t, admin, bus.BucketGatewaySessions), "s1", "p-b")
	gw2.sessionOn(t, "gw2 to learn s1 on p-b", "s1", "p-b")
}

// TestSharedSessionKeepsItsSelection: a session with labels is shared
// under its id and labels, and another gateway serves it on the same
// proxy of the selection; the same id without labels is another session.
func TestSharedSessionKeepsItsSelection(t *testing.T) {
	conn := bustest.Start(t)
	if err := bus.EnsureTopology(testwait.Context(t, 30*time.Second), conn); err != nil {
		t.Fatal(err)
	}
	put(t, bucket(t, conn, bus.BucketPools), "p", map[string]any{"name": "p", "spec": events.PoolSpec{Name: "p", Provider: "local", Size: 3}})
	proxies := bucket(t, conn, bus.BucketProxies)
	for i, id := range []string{"p-a", "p-b", "p-c"} {
		region := "eu"
		if id == "p-c" {
			region = "us"
		}
		put(t, proxies, id, events.ProxyView{ID: id, Pool: "p", State: events.ProxyReady, Address: "127.0.0.1:" + string(rune('1'+i)), Labels: map[string]string{"region": region}})
	}
	kv := bucket(t, conn, bus.BucketGatewaySessions)
	gw1, gw2 := startSessionGateway(t, conn, "gw1"), startSessionGateway(t, conn, "gw2")
	us, err := route.ParseUser("p.region-us.session-s1")
	if err != nil {
		t.Fatal(err)
	}
	us.Client = "10.0.0.1"
	if got := gw1.pick(t, us); got != "p-c" {
		t.Fatalf("the region-us session on gw1: %s; want p-c, the only us proxy", got)
	}
	storedSession(t, kv, "s1.region-us", "p-c")
	gw2.sessionOn(t, "gw2 to learn the region-us session", "s1.region-us", "p-c")
	if got := gw2.pick(t, us); got != "p-c" {
		t.Errorf("the region-us session on gw2: %s; want p-c", got)
	}
	if _, ok := gw2.table.Session("p", "s1"); ok {
		t.Errorf("gw2 holds a session s1 without labels; only s1.region-us was pinned")
	}
}

// permittedFleet starts a server with an admin and a gateway user that
// may publish what publish allows, makes the topology and the session
// fleet as admin, and returns the admin's connection and a function that
// connects as the gateway.
func permittedFleet(t *testing.T, ctx context.Context, publish *server.SubjectPermission) (*bus.Conn, func() *bus.Conn) {
	t.Helper()
	srv := bustest.Server(t, &server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		Users: []*server.User{{Username: "admin", Password: "admin-pw"},
			{Username: "gateway", Password: "gateway-pw", Permissions: &server.Permissions{Publish: publish}}}})
	dial := func(user, password string) *bus.Conn {
		t.Helper()
		c, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), User: user, Password: password, Name: user}, nil)
		if err != nil {
			t.Fatalf("connect as %s: %v", user, err)
		}
		t.Cleanup(c.Close)
		return c
	}
	admin := dial("admin", "admin-pw")
	if err := bus.EnsureTopology(ctx, admin); err != nil {
		t.Fatal(err)
	}
	sessionFleet(t, admin, nil)
	return admin, func() *bus.Conn { return dial("gateway", "gateway-pw") }
}
