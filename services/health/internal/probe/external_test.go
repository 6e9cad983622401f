package probe_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
)

// externalPool records an external pool listing addrs, as the planner's
// apply does: the public spec (no credentials) in the log.
func (f *fleet) externalPool(pool string, addrs ...string) {
	f.t.Helper()
	spec := events.PoolSpec{Name: pool, Provider: events.ProviderExternal, Size: len(addrs), External: &events.External{}}
	for _, a := range addrs {
		spec.External.Proxies = append(spec.External.Proxies, events.ExternalProxy{URL: "http://" + a})
	}
	f.append(events.AggregatePool, pool, events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1})
}

// setExternalCreds seals pool's external credentials (by address) to the
// probers' key, as the planner does.
func (f *fleet) setExternalCreds(pool string, rev int, creds map[string]events.ProxyAuth) {
	f.t.Helper()
	kv, err := f.conn.JS.KeyValue(f.ctx, bus.BucketProbeCreds)
	if err != nil {
		f.t.Fatal(err)
	}
	f.eventually("the probe key announced", func() bool {
		e, err := kv.Get(f.ctx, events.ProbeRecipientKey)
		return err == nil && string(e.Value()) == seal.Public(f.key)
	})
	plain, _ := json.Marshal(events.ProbeSecret{Pool: pool, External: creds})
	box, err := seal.Seal(plain, seal.Public(f.key))
	if err != nil {
		f.t.Fatal(err)
	}
	raw, _ := json.Marshal(events.ProbeCredential{Revision: rev, Sealed: *box})
	if _, err := kv.Put(f.ctx, pool, raw); err != nil {
		f.t.Fatal(err)
	}
}

// externalProxy records an external proxy of pool at addr as the planner
// does: requested on entry and target external, then running as that
// entry's agent.
func (f *fleet) externalProxy(id, pool, addr string) {
	f.t.Helper()
	x := events.ProviderExternal
	if _, err := bus.NewEventStore(f.conn, events.SourcePlanner, nil).Append(f.ctx, events.AggregateProxy, id, events.ProxyRequested, id+".requested.1", events.ProxyRequestedData{
		ProxySpec: events.ProxySpec{Pool: pool, Entry: x, Target: x, Instance: events.InstanceName(id), Revision: 1, Port: 3128},
	}, nil); err != nil {
		f.t.Fatal(err)
	}
	if _, err := bus.NewEventStore(f.conn, events.AgentSource(x, x), nil).Append(f.ctx, events.AggregateProxy, id, events.ProxyRunning, id+".running.1", events.ProxyRunningData{Address: addr, Attempt: 1}, nil); err != nil {
		f.t.Fatal(err)
	}
}

// disable appends the planner's disabled decision for id until until.
func (f *fleet) disable(id string, n int, until time.Time, reason string) {
	f.t.Helper()
	if _, err := bus.NewEventStore(f.conn, events.SourcePlanner, nil).Append(f.ctx, events.AggregateProxy, id, events.ProxyDisabled, id+".disabled."+string(rune('0'+n)), events.ProxyDisabledData{Until: until, Reason: reason}, nil); err != nil {
		f.t.Fatal(err)
	}
}

// TestExternalProxiesProbedWithTheirOwnCredentials: each proxy of an
// external pool is probed with the credentials of its address from the
// sealed probe secret, never another member's; a member whose credentials
// are missing or wrong fails its probes (407) and is never ready; no
// credential reaches the logs or the probe records.
func TestExternalProxiesProbedWithTheirOwnCredentials(t *testing.T) {
	f := startFleet(t)
	a := newFwdProxy(t, "127.0.0.1", "alice", "pw-alice-31")
	b := newFwdProxy(t, "127.0.0.1", "bob", "pw-bob-47")
	missing := newFwdProxy(t, "127.0.0.1", "carol", "pw-carol-59")
	wrong := newFwdProxy(t, "127.0.0.1", "dave", "pw-dave-61")
	f.externalPool("bought", a.addr, b.addr, missing.addr, wrong.addr)
	f.setExternalCreds("bought", 1, map[string]events.ProxyAuth{
		a.addr:     {Username: "alice", Password: "pw-alice-31"},
		b.addr:     {Username: "bob", Password: "pw-bob-47"},
		wrong.addr: {Username: "dave", Password: "pw-not-daves-67"},
	})
	f.externalProxy("bought-a", "bought", a.addr)
	f.externalProxy("bought-b", "bought", b.addr)
	f.externalProxy("bought-c", "bought", missing.addr)
	f.externalProxy("bought-d", "bought", wrong.addr)

	f.waitState("bought-a", events.ProxyReady)
	f.waitState("bought-b", events.ProxyReady)
	if a.rejected.Load() != 0 || b.rejected.Load() != 0 {
		t.Fatalf("listed members refused %d and %d probes: a member was probed with another's credentials", a.rejected.Load(), b.rejected.Load())
	}
	for _, id := range []string{"bought-c", "bought-d"} {
		f.eventually(id+" failing past the unhealthy threshold", func() bool { return f.record(id).Streak >= unhealthyAfter+1 })
		if rec := f.record(id); !strings.Contains(rec.LastError, "407") {
			t.Fatalf("%s, without its credentials: last error %q, want a 407", id, rec.LastError)
		}
		if st, n := f.state(id), len(f.kinds(id)[events.ProxyReady]); st != events.ProxyRunning || n != 0 {
			t.Fatalf("%s: state %q with %d ready events, want running and none", id, st, n)
		}
	}
	if missing.rejected.Load() == 0 || wrong.rejected.Load() == 0 {
		t.Fatal("the members without their credentials were never refused: were they probed?")
	}
	probes, err := f.conn.JS.KeyValue(f.ctx, bus.BucketProbes)
	if err != nil {
		t.Fatal(err)
	}
	var records strings.Builder
	for _, id := range []string{"bought-a", "bought-b", "bought-c", "bought-d"} {
		if e, err := probes.Get(f.ctx, id); err == nil {
			records.Write(e.Value())
		}
	}
	for _, s := range []string{"pw-alice-31", "pw-bob-47", "pw-carol-59", "pw-dave-61", "pw-not-daves-67"} {
		if strings.Contains(f.logs.String(), s) || strings.Contains(records.String(), s) {
			t.Fatalf("the credential %q appears in the logs or the probe records", s)
		}
	}
}

// TestDisabledProxyReturnsAfterItsTimeOnAGoodProbe: a disabled external
// proxy is still probed; a good probe before its time appends nothing, a
// failed one after its time appends nothing (neither ready nor unhealthy),
// and the first good probe once its time has passed appends ready, which
// returns it to service. The fleet-proxies view shows the state and when
// the proxy may return.
func TestDisabledProxyReturnsAfterItsTimeOnAGoodProbe(t *testing.T) {
	f := startFleet(t)
	early := newFwdProxy(t, "127.0.0.1", "erin", "pw-erin-71")
	failing := newFwdProxy(t, "127.0.0.1", "fred", "pw-fred-73")
	f.externalPool("bought", early.addr, failing.addr)
	f.setExternalCreds("bought", 1, map[string]events.ProxyAuth{
		early.addr:   {Username: "erin", Password: "pw-erin-71"},
		failing.addr: {Username: "fred", Password: "pw-fred-73"},
	})
	f.externalProxy("bought-e", "bought", early.addr)
	f.externalProxy("bought-f", "bought", failing.addr)
	f.waitState("bought-e", events.ProxyReady)
	f.waitState("bought-f", events.ProxyReady)

	// bought-f now refuses health's credentials, and both are disabled:
	// bought-e for a while, bought-f for a moment.
	failing.setPass("changed-by-the-seller")
	disabledAt := time.Now().UTC()
	untilE := disabledAt.Add(6 * time.Second).Truncate(time.Millisecond)
	untilF := disabledAt.Add(time.Second).Truncate(time.Millisecond)
	f.disable("bought-e", 1, untilE, "banned: captcha")
	f.disable("bought-f", 1, untilF, "unhealthy for 2m0s: 407")

	var v events.ProxyView
	f.eventually("bought-e disabled in the view", func() bool {
		return f.get(bus.BucketProxies, "bought-e", &v) && v.State == events.ProxyDisabled
	})
	if !v.DisabledUntil.Equal(untilE) || v.Reason != "banned: captcha" {
		t.Fatalf("bought-e in the view: disabledUntil %v, reason %q; want %v and the planner's reason", v.DisabledUntil, v.Reason, untilE)
	}
	raw := f.rawView("bought-e")
	if !strings.Contains(raw, `"state":"disabled"`) || !strings.Contains(raw, `"disabledUntil":"`) {
		t.Fatalf("the view's value %s does not show disabled and disabledUntil", raw)
	}

	// Good probes before its time: still disabled.
	f.eventually("good probes of bought-e while disabled", func() bool {
		r := f.record("bought-e")
		return r.OK && r.State == events.ProxyDisabled && r.CheckedAt.After(disabledAt)
	})
	// A failing proxy past its time: probed, nothing appended.
	f.eventually("failed probes of bought-f past its time", func() bool {
		r := f.record("bought-f")
		return !r.OK && r.CheckedAt.After(untilF) && r.Streak >= unhealthyAfter+1
	})
	if st := f.state("bought-f"); st != events.ProxyDisabled {
		t.Fatalf("bought-f after failed probes past its time: %q, want still disabled", st)
	}

	// bought-e returns on its own once its time has passed.
	f.waitState("bought-e", events.ProxyReady)
	readies := f.kinds("bought-e")[events.ProxyReady]
	last := readies[len(readies)-1]
	if last.Time.Before(untilE) {
		t.Fatalf("bought-e ready at %v, before its time %v", last.Time, untilE)
	}
	if len(readies) != 2 {
		t.Fatalf("bought-e has %d ready events, want 2 (the first, and the return)", len(readies))
	}
	f.eventually("bought-e's view to drop disabledUntil", func() bool {
		var v events.ProxyView
		return f.get(bus.BucketProxies, "bought-e", &v) && v.State == events.ProxyReady && v.DisabledUntil.IsZero()
	})

	// bought-f returns once a probe succeeds again.
	if k := f.kinds("bought-f"); len(k[events.ProxyReady]) != 1 || len(k[events.ProxyUnhealthy]) != 0 {
		t.Fatalf("bought-f while failing disabled: %d ready and %d unhealthy events, want the first ready only", len(k[events.ProxyReady]), len(k[events.ProxyUnhealthy]))
	}
	failing.setPass("pw-fred-73")
	f.waitState("bought-f", events.ProxyReady)
}

// rawView returns the fleet-proxies value of id as stored.
func (f *fleet) rawView(id string) string {
	f.t.Helper()
	kv, err := f.conn.JS.KeyValue(f.ctx, bus.BucketProxies)
	if err != nil {
		f.t.Fatal(err)
	}
	e, err := kv.Get(f.ctx, id)
	if err != nil {
		f.t.Fatal(err)
	}
	return string(e.Value())
}
