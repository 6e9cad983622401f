package probe_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"go.uber.org/goleak"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/health/internal/echo"
	"proxyfleet/services/health/internal/probe"
	"proxyfleet/services/health/internal/projection"
)

func TestMain(m *testing.M) {
	// bus.EventStore.Load returns once it has the aggregate's last event and
	// leaves its pull request to expire on the server; that fetch goroutine
	// is the event store's, not ours.
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/nats-io/nats.go/jetstream.(*pullConsumer).fetch.func1"))
}

const unhealthyAfter = 3

// fleet is one test's NATS, projection, echo endpoint and prober.
type fleet struct {
	t     *testing.T
	ctx   context.Context
	conn  *bus.Conn
	store *bus.EventStore
	logs  *testwait.Buffer
	// key is the probers' shared curve key.
	key nkeys.KeyPair
}

func startFleet(t *testing.T) *fleet { return startFleetN(t, 1) }

// startFleetN starts n probers side by side, as a crashed prober and its
// replacement, or two health replicas, would run.
func startFleetN(t *testing.T, n int) *fleet { return startFleetEvery(t, n, 50*time.Millisecond) }

// startFleetEvery starts n probers that probe each proxy every interval.
func startFleetEvery(t *testing.T, n int, interval time.Duration) *fleet {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	c := bustest.Start(t)
	echoSrv := httptest.NewServer(echo.Handler())
	t.Cleanup(echoSrv.Close)
	logs := &testwait.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	f := &fleet{t: t, ctx: ctx, conn: c, store: bus.NewEventStore(c, "test", nil), logs: logs, key: key}

	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = projection.New(c, log, nil).Run(rctx) }()
	for range n {
		pr, err := probe.New(c, probe.Config{
			EchoURL: echoSrv.URL + "/", Interval: interval, Timeout: 2 * time.Second,
			Concurrency: 4, UnhealthyAfter: unhealthyAfter, Key: key,
		}, log, nil)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := pr.Run(rctx); err != nil {
				t.Errorf("prober: %v", err)
			}
		}()
	}
	t.Cleanup(func() { stop(); wg.Wait() })
	return f
}

// setProbePassword stores pool's probe password as the planner does:
// sealed to the key the probers announced (to is that key unless set).
func (f *fleet) setProbePassword(pool string, rev int, pw string, to string) {
	f.t.Helper()
	kv, err := f.conn.JS.KeyValue(f.ctx, bus.BucketProbeCreds)
	if err != nil {
		f.t.Fatal(err)
	}
	if to == "" {
		f.eventually("the probe key announced", func() bool {
			e, err := kv.Get(f.ctx, events.ProbeRecipientKey)
			return err == nil && string(e.Value()) == seal.Public(f.key)
		})
		to = seal.Public(f.key)
	}
	plain, _ := json.Marshal(events.ProbeSecret{Pool: pool, Password: pw})
	box, err := seal.Seal(plain, to)
	if err != nil {
		f.t.Fatal(err)
	}
	raw, _ := json.Marshal(events.ProbeCredential{Revision: rev, Sealed: *box})
	if _, err := kv.Put(f.ctx, pool, raw); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fleet) append(agg, id, kind string, data any) {
	f.t.Helper()
	if _, err := bus.NewEventStore(f.conn, bustest.Source(agg, kind), nil).Append(f.ctx, agg, id, kind, id+"."+kind+".t", data, nil); err != nil {
		f.t.Fatal(err)
	}
}

// runningProxy records a proxy of pool as requested and running at addr.
func (f *fleet) runningProxy(id, pool, user, addr string) {
	f.t.Helper()
	f.append(events.AggregateProxy, id, events.ProxyRequested, events.ProxyRequestedData{
		ProxySpec: events.ProxySpec{Pool: pool, Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128},
		Username:  user,
	})
	f.append(events.AggregateProxy, id, events.ProxyRunning, events.ProxyRunningData{Address: addr, Attempt: 1})
}

func (f *fleet) eventually(what string, cond func() bool) {
	f.t.Helper()
	if testwait.For(f.ctx, cond) != nil {
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		f.t.Fatalf("timed out waiting for %s; log tail:\n%s\nstacks:\n%s", what, tail(f.logs.String(), 4000), buf[:n])
	}
}

func (f *fleet) get(bucket, key string, out any) bool {
	f.t.Helper()
	kv, err := f.conn.JS.KeyValue(f.ctx, bucket)
	if err != nil {
		f.t.Fatal(err)
	}
	e, err := kv.Get(f.ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) || f.ctx.Err() != nil {
		return false // a timeout is reported by eventually, with what it waited for
	}
	if err != nil {
		f.t.Fatal(err)
	}
	if err := json.Unmarshal(e.Value(), out); err != nil {
		f.t.Fatal(err)
	}
	return true
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func (f *fleet) state(id string) string {
	var v projection.Proxy
	f.get(bus.BucketProxies, id, &v)
	return v.State
}

func (f *fleet) record(id string) probe.Record {
	var r probe.Record
	f.get(bus.BucketProbes, id, &r)
	return r
}

func (f *fleet) waitState(id, want string) {
	f.t.Helper()
	f.eventually(id+" "+want, func() bool { return f.state(id) == want })
}

// waitProbes waits until n more probes of id were recorded.
func (f *fleet) waitProbes(id string, n int) {
	f.t.Helper()
	seen := map[time.Time]bool{f.record(id).CheckedAt: true}
	f.eventually("more probes of "+id, func() bool {
		seen[f.record(id).CheckedAt] = true
		return len(seen) > n
	})
}

// kinds returns the events of one proxy, by kind.
func (f *fleet) kinds(id string) map[string][]bus.Event {
	f.t.Helper()
	evs, err := f.store.Load(f.ctx, events.AggregateProxy, id)
	if err != nil {
		f.t.Fatal(err)
	}
	out := map[string][]bus.Event{}
	for _, e := range evs {
		out[e.Kind] = append(out[e.Kind], e)
	}
	return out
}

// TestSuspectIsProbedAtOnce: a suspect report on fleet.health.suspect
// (a gateway saw a request through the proxy fail) makes the replica
// probe the proxy at once, not at its next interval an hour away.
func TestSuspectIsProbedAtOnce(t *testing.T) {
	f := startFleetEvery(t, 1, time.Hour)
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	f.runningProxy("demo-s", "demo", "", fp.addr)
	raw, _ := json.Marshal(events.Suspect{ID: "demo-s", Reason: "gateway: connection refused"})
	report := func() {
		if err := f.conn.NC.Publish(events.SuspectSubject, raw); err != nil {
			f.t.Fatal(err)
		}
	}
	// The first probe of a new proxy is due within a quarter interval
	// (15 min): the report brings it forward. The prober may not have
	// seen the proxy yet, so the report repeats until it is ready.
	f.eventually("demo-s ready after a suspect report", func() bool {
		report()
		time.Sleep(50 * time.Millisecond)
		return f.state("demo-s") == events.ProxyReady
	})
	// The next probe is due in an hour: only a report brings it now.
	first := f.record("demo-s").CheckedAt
	f.eventually("a second probe of demo-s after a suspect report", func() bool {
		report()
		time.Sleep(50 * time.Millisecond)
		return f.record("demo-s").CheckedAt.After(first)
	})
	// A malformed report changes nothing and stops nothing.
	if err := f.conn.NC.Publish(events.SuspectSubject, []byte("not json")); err != nil {
		t.Fatal(err)
	}
	second := f.record("demo-s").CheckedAt
	f.eventually("a third probe after a malformed report", func() bool {
		report()
		time.Sleep(50 * time.Millisecond)
		return f.record("demo-s").CheckedAt.After(second)
	})
}

func TestTransitionsOnlyOnChange(t *testing.T) {
	f := startFleet(t)
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	f.runningProxy("demo-a", "demo", "", fp.addr)

	f.waitState("demo-a", events.ProxyReady)
	f.waitProbes("demo-a", 3)
	k := f.kinds("demo-a")
	if len(k[events.ProxyReady]) != 1 {
		t.Fatalf("ready events: got %d, want 1", len(k[events.ProxyReady]))
	}
	var ready events.ProxyReadyData
	if err := k[events.ProxyReady][0].DecodeData(&ready); err != nil {
		t.Fatal(err)
	}
	if ready.EgressIP != "127.0.0.1" || ready.Address != fp.addr {
		t.Fatalf("ready: got %+v, want egress 127.0.0.1 at %s", ready, fp.addr)
	}
	if fp.served.Load() == 0 {
		t.Fatal("the forward proxy served nothing: the probe did not go through it")
	}

	fp.stop()
	f.waitState("demo-a", events.ProxyUnhealthy)
	f.eventually("failure streak past the threshold", func() bool { return f.record("demo-a").Streak >= unhealthyAfter+2 })
	k = f.kinds("demo-a")
	if len(k[events.ProxyUnhealthy]) != 1 {
		t.Fatalf("unhealthy events: got %d, want 1", len(k[events.ProxyUnhealthy]))
	}
	var bad events.ProxyUnhealthyData
	if err := k[events.ProxyUnhealthy][0].DecodeData(&bad); err != nil {
		t.Fatal(err)
	}
	if bad.Streak != unhealthyAfter || bad.Reason == "" {
		t.Fatalf("unhealthy: got %+v, want streak %d and a reason", bad, unhealthyAfter)
	}
	if rec := f.record("demo-a"); rec.OK || rec.LastError == "" || rec.LastOKAt == nil {
		t.Fatalf("probe record while down: %+v", rec)
	}

	fp.start() // same port
	f.waitState("demo-a", events.ProxyReady)
	f.waitProbes("demo-a", 3)
	k = f.kinds("demo-a")
	if len(k[events.ProxyReady]) != 2 || len(k[events.ProxyUnhealthy]) != 1 {
		t.Fatalf("after recovery: %d ready and %d unhealthy events, want 2 and 1", len(k[events.ProxyReady]), len(k[events.ProxyUnhealthy]))
	}
	if rec := f.record("demo-a"); !rec.OK || !rec.HTTPOK || !rec.ConnectOK || rec.Streak != 0 || rec.EgressIP != "127.0.0.1" {
		t.Fatalf("probe record after recovery: %+v", rec)
	}
}

// Two probers deciding on the same view append the same message id, so
// NATS keeps one event: what makes a crash-retry of a transition harmless.
func TestConcurrentProbersAppendOneTransition(t *testing.T) {
	f := startFleetN(t, 2)
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	f.runningProxy("demo-a", "demo", "", fp.addr)
	f.waitState("demo-a", events.ProxyReady)
	f.waitProbes("demo-a", 4)
	if n := len(f.kinds("demo-a")[events.ProxyReady]); n != 1 {
		t.Fatalf("ready events: got %d, want 1", n)
	}
}

func TestProbesWithPoolPassword(t *testing.T) {
	f := startFleet(t)
	const password = "s3cret-Pa55"
	spec := events.PoolSpec{Name: "authed", Provider: "local", Size: 1, Port: 3128, Auth: &events.ProxyAuth{Username: "crawler"}}
	f.append(events.AggregatePool, "authed", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1})
	f.setProbePassword("authed", 1, password, "")
	good := newFwdProxy(t, "127.0.0.1", "crawler", password)
	f.runningProxy("authed-a", "authed", "crawler", good.addr)

	// A pool whose password is not in fleet-probe-creds: its proxy refuses
	// the probe, which proves the password is what made the first one pass.
	noSecret := newFwdProxy(t, "127.0.0.1", "crawler", "other")
	f.runningProxy("nosecret-a", "nosecret", "crawler", noSecret.addr)

	// Health never reads fleet-secrets: a password only there is not used.
	const onlyThere = "only-in-fleet-secrets-9"
	secrets, err := f.conn.JS.KeyValue(f.ctx, bus.BucketSecrets)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(events.PoolSecrets{Revision: 1, Password: onlyThere})
	if _, err := secrets.Put(f.ctx, "plainsecret", raw); err != nil {
		t.Fatal(err)
	}
	plainSecret := newFwdProxy(t, "127.0.0.1", "crawler", onlyThere)
	f.runningProxy("plainsecret-a", "plainsecret", "crawler", plainSecret.addr)

	// A credential sealed to another key does not open: probed without it.
	other, _ := seal.NewKey()
	const otherPw = "sealed-to-another-key-7"
	f.setProbePassword("otherkey", 1, otherPw, seal.Public(other))
	otherKey := newFwdProxy(t, "127.0.0.1", "crawler", otherPw)
	f.runningProxy("otherkey-a", "otherkey", "crawler", otherKey.addr)

	f.waitState("authed-a", events.ProxyReady)
	// Never ready, they stay running (the planner's ready timeout deals
	// with them); their failures are in fleet-probes.
	for _, id := range []string{"nosecret-a", "plainsecret-a", "otherkey-a"} {
		f.eventually(id+" failing past the unhealthy threshold", func() bool { return f.record(id).Streak >= unhealthyAfter+1 })
		if rec := f.record(id); !strings.Contains(rec.LastError, "407") {
			t.Fatalf("%s, without a password it can open: last error %q, want a 407", id, rec.LastError)
		}
		if st, n := f.state(id), len(f.kinds(id)[events.ProxyUnhealthy]); st != events.ProxyRunning || n != 0 {
			t.Fatalf("%s, never ready: state %q with %d unhealthy events, want running and none", id, st, n)
		}
	}
	if !strings.Contains(f.logs.String(), "same --probe-key-file") {
		t.Error("a credential sealed to another key is not reported with what to do")
	}
	for _, s := range []string{onlyThere, otherPw} {
		if strings.Contains(f.logs.String(), s) {
			t.Fatalf("the logs hold the password %q", s)
		}
	}
	if good.rejected.Load() != 0 {
		t.Fatalf("the authenticated proxy rejected %d requests", good.rejected.Load())
	}
	if strings.Contains(f.logs.String(), password) {
		t.Fatal("the password appears in the logs")
	}
	for _, id := range []string{"authed-a", "nosecret-a"} {
		b, _ := json.Marshal(f.record(id))
		if bytes.Contains(b, []byte(password)) {
			t.Fatalf("the password appears in the probe record of %s", id)
		}
	}
}

// Probes read a pool's password again a short while after it changed: a
// rotated password is in use without a restart.
func TestProbesPickUpARotatedPassword(t *testing.T) {
	f := startFleet(t)
	spec := events.PoolSpec{Name: "rot", Provider: "local", Size: 1, Port: 3128, Auth: &events.ProxyAuth{Username: "crawler"}}
	f.append(events.AggregatePool, "rot", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1})
	setSecret := func(rev int, pw string) {
		t.Helper()
		f.setProbePassword("rot", rev, pw, "")
	}
	setSecret(1, "first-Pa55")
	fp := newFwdProxy(t, "127.0.0.1", "crawler", "first-Pa55")
	f.runningProxy("rot-a", "rot", "", fp.addr)
	f.waitState("rot-a", events.ProxyReady)

	fp.setPass("second-Pa55")
	setSecret(2, "second-Pa55")
	rotated := time.Now().UTC()
	// One probe may have started before the rotation; the second passing
	// probe checked after it started after it, with the new password.
	passed := map[time.Time]bool{}
	f.eventually("probes passing with the new password", func() bool {
		if r := f.record("rot-a"); r.OK && r.CheckedAt.After(rotated) {
			passed[r.CheckedAt] = true
		}
		return len(passed) >= 2
	})
}

func TestSharedEgressIsFlagged(t *testing.T) {
	f := startFleet(t)
	a := newFwdProxy(t, "127.0.0.1", "", "")
	b := newFwdProxy(t, "127.0.0.1", "", "")
	c := newFwdProxy(t, "127.0.0.2", "", "") // another loopback address
	f.runningProxy("p-a", "demo", "", a.addr)
	f.runningProxy("p-b", "demo", "", b.addr)
	f.runningProxy("p-c", "demo", "", c.addr)

	// p-a and p-b form the group 127.0.0.1, each counting the other.
	f.eventually("shared egress flags", func() bool {
		ra, rb := f.record("p-a"), f.record("p-b")
		return ra.SharedEgress == 1 && ra.EgressIP == "127.0.0.1" &&
			rb.SharedEgress == 1 && rb.EgressIP == "127.0.0.1" &&
			f.record("p-c").EgressIP == "127.0.0.2"
	})
	if rc := f.record("p-c"); rc.SharedEgress != 0 {
		t.Fatalf("p-c egresses alone but is flagged as sharing with %d others", rc.SharedEgress)
	}

	// p-b's proxy comes back egressing from 127.0.0.2: it moves to p-c's
	// group and leaves p-a alone.
	b.stop()
	b.setSource("127.0.0.2")
	b.start()
	f.eventually("p-b in the group 127.0.0.2", func() bool {
		ra, rb, rc := f.record("p-a"), f.record("p-b"), f.record("p-c")
		return ra.SharedEgress == 0 && rb.EgressIP == "127.0.0.2" && rb.SharedEgress == 1 && rc.SharedEgress == 1
	})

	// A retiring proxy is no longer probed: stopping it emits nothing.
	f.waitState("p-c", events.ProxyReady)
	f.append(events.AggregateProxy, "p-c", events.ProxyRetiring, events.ProxyRetiringData{Reason: "test"})
	f.waitState("p-c", events.ProxyRetiring)
	c.stop()
	f.waitProbes("p-a", unhealthyAfter+3)
	f.eventually("p-b alone once p-c is no longer probed", func() bool {
		rb := f.record("p-b")
		return rb.SharedEgress == 0 && rb.EgressIP == "127.0.0.2"
	})
	if n := len(f.kinds("p-c")[events.ProxyUnhealthy]); n != 0 {
		t.Fatalf("retiring proxy got %d unhealthy events, want 0", n)
	}
	if f.state("p-c") != events.ProxyRetiring {
		t.Fatalf("p-c state: got %q, want retiring", f.state("p-c"))
	}

	// Once the proxy is gone, so is its probe record.
	f.append(events.AggregateProxy, "p-c", events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1})
	f.eventually("p-c's probe record removed", func() bool {
		var r probe.Record
		return !f.get(bus.BucketProbes, "p-c", &r)
	})
}

func TestParseEcho(t *testing.T) {
	for _, tc := range []struct {
		body, want string
		ok         bool
	}{
		{`{"ip":"203.0.113.9"}`, "203.0.113.9", true},
		{"{\"ip\":\"2001:db8::1\",\"country\":\"NL\"}\n", "2001:db8::1", true},
		{"198.51.100.4\n", "198.51.100.4", true},
		{"::ffff:192.0.2.1", "192.0.2.1", true},
		{`{"ip":""}`, "", false},
		{"<html>blocked</html>", "", false},
		{`{"ip":`, "", false},
	} {
		got, err := probe.ParseEcho([]byte(tc.body))
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseEcho(%q) = %q, %v; want %q, ok=%v", tc.body, got, err, tc.want, tc.ok)
		}
	}
}
